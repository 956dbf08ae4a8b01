"""Stage 4, destination passing: the ``@kernel`` entry that loops the bodies over rows.

    kernel(n, inputs..., outputs...)        all memrefs over PyTorch-owned storage
      for i in [0, n − n mod R) step R:     body_R on rows i..i+R   (static shapes)
      for i in [n − n mod R, n):            body_1 on row i         (the tail)
      row outputs:  written in place into the caller's output rows (materialize_in_destination)
      sum outputs:  fp32 accumulators carried through both loops, written once at the end

Inputs are read in place (``to_tensor restrict``): any row stride, inner stride 1. ``n``
is the only dynamic size, so one kernel serves every batch × sequence length.
"""
from __future__ import annotations

import torch

from .capture import ROW, Captured

ELEMENT = {
    torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.float64: "f64",
    torch.int64: "i64", torch.int32: "i32", torch.bool: "i1",
}


def _dims(shape) -> str:
    return "".join(f"{d}x" for d in shape)


def _strided(rank: int, inner_unit: bool = True) -> str:
    if rank == 0:
        return ""
    strides = ["?"] * rank
    if inner_unit:
        strides[-1] = "1"
    return f", strided<[{', '.join(strides)}]>"


def arg_memref(role: str, shape, dtype) -> str:
    """Memref type of a kernel argument (row: leading dynamic dim)."""
    t = ELEMENT[dtype]
    if role == ROW:
        return f"memref<?x{_dims(shape)}{t}{_strided(len(shape) + 1)}>"
    return f"memref<{_dims(shape)}{t}{_strided(len(shape))}>"


def _chunk_memref(shape, dtype, rows: int) -> str:
    rank = len(shape) + 1
    strides = ["?"] * rank
    strides[-1] = "1"
    return f"memref<{rows}x{_dims(shape)}{ELEMENT[dtype]}, strided<[{', '.join(strides)}], offset: ?>>"


def _tensor(shape, dtype, rows: int | None = None) -> str:
    lead = "" if rows is None else f"{rows}x"
    return f"tensor<{lead}{_dims(shape)}{ELEMENT[dtype]}>"


def signature(cap: Captured) -> list[tuple[str, tuple, torch.dtype]]:
    """(role, shape, dtype) of every kernel argument after ``n``: inputs, then outputs."""
    sig = [(a.role, a.shape, a.dtype) for a in cap.args]
    sig += [(r, s, d) for r, s, d in zip(cap.out_roles, cap.out_shapes, cap.out_dtypes)]
    return sig


def _subview(name: str, src: str, role_shape, dtype, rows: int, iv: str) -> str:
    rank = len(role_shape) + 1
    offs = ", ".join([iv] + ["0"] * (rank - 1))
    sizes = ", ".join([str(rows)] + [str(d) for d in role_shape])
    ones = ", ".join(["1"] * rank)
    src_t = arg_memref(ROW, role_shape, dtype)
    return f"%{name} = memref.subview {src}[{offs}] [{sizes}] [{ones}] : {src_t} to {_chunk_memref(role_shape, dtype, rows)}"


def _loop(cap: Captured, rows: int, lo: str, hi: str, accs_in: list[str], tag: str) -> list[str]:
    sums = [i for i, r in enumerate(cap.out_roles) if r == "sum"]
    acc_types = [_tensor(cap.out_shapes[i], torch.float32) for i in sums]
    res = f"%{tag}:{len(sums)} = " if sums else ""
    iters = ""
    if sums:
        iters = " iter_args(" + ", ".join(f"%{tag}_acc{k} = {a}" for k, a in enumerate(accs_in)) + ") -> (" + ", ".join(acc_types) + ")"
    step = f"%c{rows}"
    lines = [f"{res}scf.for %{tag}_i = {lo} to {hi} step {step}{iters} {{"]
    call_args, call_types = [], []
    for k, a in enumerate(cap.args):
        if a.role == ROW:
            lines.append("  " + _subview(f"{tag}_in{k}", f"%arg{k}", a.shape, a.dtype, rows, f"%{tag}_i"))
            lines.append(f"  %{tag}_t{k} = bufferization.to_tensor %{tag}_in{k} restrict : {_chunk_memref(a.shape, a.dtype, rows)} to {_tensor(a.shape, a.dtype, rows)}")
            call_args.append(f"%{tag}_t{k}")
            call_types.append(_tensor(a.shape, a.dtype, rows))
        else:
            call_args.append(f"%bc{k}")
            call_types.append(_tensor(a.shape, a.dtype))
    out_types = [
        _tensor(s, d, rows) if r == ROW else _tensor(s, d)
        for r, s, d in zip(cap.out_roles, cap.out_shapes, cap.out_dtypes)
    ]
    nout = len(out_types)
    lines.append(f"  %{tag}_r:{nout} = func.call @body_{rows}({', '.join(call_args)}) : ({', '.join(call_types)}) -> ({', '.join(out_types)})")
    yields = []
    base = len(cap.args)
    for j, (r, s, d) in enumerate(zip(cap.out_roles, cap.out_shapes, cap.out_dtypes)):
        if r == ROW:
            lines.append("  " + _subview(f"{tag}_out{j}", f"%arg{base + j}", s, d, rows, f"%{tag}_i"))
            lines.append(
                f"  bufferization.materialize_in_destination %{tag}_r#{j} in restrict writable %{tag}_out{j}"
                f" : ({out_types[j]}, {_chunk_memref(s, d, rows)}) -> ()"
            )
        else:
            k = sums.index(j)
            t = acc_types[k]
            rank = len(cap.out_shapes[j])
            ident = f"affine_map<({', '.join(f'd{q}' for q in range(rank))}) -> ({', '.join(f'd{q}' for q in range(rank))})>"
            par = ", ".join(['"parallel"'] * rank)
            # The accumulator is the op's init and is read by the payload, so the sum stays in
            # place in the loop-carried buffer through fusion and bufferization.
            lines.append(
                f"  %{tag}_s{k} = linalg.generic {{indexing_maps = [{ident}, {ident}], iterator_types = [{par}]}}"
                f" ins(%{tag}_r#{j} : {t}) outs(%{tag}_acc{k} : {t}) {{\n"
                f"  ^bb0(%in: f32, %acc: f32):\n    %sum = arith.addf %in, %acc : f32\n    linalg.yield %sum : f32\n  }} -> {t}"
            )
            yields.append(f"%{tag}_s{k}")
    if yields:
        lines.append(f"  scf.yield {', '.join(yields)} : {', '.join(acc_types)}")
    lines.append("}")
    return lines


def kernel_text(cap: Captured) -> str:
    """The MLIR text of ``@kernel`` (to be appended to the module holding the bodies)."""
    sig = signature(cap)
    params = ["%n: index"] + [f"%arg{i}: {arg_memref(r, s, d)}" for i, (r, s, d) in enumerate(sig)]
    body = [
        f"func.func @kernel({', '.join(params)}) attributes {{llvm.emit_c_interface}} {{",
        "%c0 = arith.constant 0 : index",
        "%c1 = arith.constant 1 : index",
        f"%c{cap.rows} = arith.constant {cap.rows} : index",
        "%zero = arith.constant 0.0 : f32",
    ]
    for k, a in enumerate(cap.args):
        if a.role != ROW:
            body.append(f"%bc{k} = bufferization.to_tensor %arg{k} restrict : {arg_memref(a.role, a.shape, a.dtype)} to {_tensor(a.shape, a.dtype)}")
    sums = [i for i, r in enumerate(cap.out_roles) if r == "sum"]
    accs = []
    for k, j in enumerate(sums):
        t = _tensor(cap.out_shapes[j], torch.float32)
        body.append(f"%e{k} = tensor.empty() : {t}")
        body.append(f"%z{k} = linalg.fill ins(%zero : f32) outs(%e{k} : {t}) -> {t}")
        accs.append(f"%z{k}")
    body.append(f"%nq = arith.divui %n, %c{cap.rows} : index")
    body.append(f"%nmain = arith.muli %nq, %c{cap.rows} : index")
    body += _loop(cap, cap.rows, "%c0", "%nmain", accs, "main")
    tail_in = [f"%main#{k}" for k in range(len(sums))]
    body += _loop(cap, 1, "%nmain", "%n", tail_in, "tail")
    base = len(cap.args)
    for k, j in enumerate(sums):
        t = _tensor(cap.out_shapes[j], torch.float32)
        mt = arg_memref("sum", cap.out_shapes[j], torch.float32)
        body.append(f"bufferization.materialize_in_destination %tail#{k} in restrict writable %arg{base + j} : ({t}, {mt}) -> ()")
    body.append("return")
    body.append("}")
    return "\n".join(body)
