"""Every Triton kernel of the backend as its launchers launch it, compiled for a GPU that is not here.

``record_launches()`` calls the real launchers (``rms_norm_fwd``, ``swiglu_bwd``, ...) on *meta*
tensors for representative shapes and dtypes, with ``Launcher.__call__`` replaced by a recorder:
nothing runs, and what is recorded (kernel, grid, arguments, constexprs, ``num_warps``,
``num_stages``) is exactly what the launcher would have launched, config choices included. Under
``targets.simulate(target)`` the launchers choose for that target (warp size, shared memory, SM
count). ``compile_launch`` turns one recorded launch into Triton's signature, specialisation
attributes and options the way ``JITFunction.run`` does (Triton's own binder, built for the
target's backend), and compiles it with ``triton.compile(..., target=GPUTarget(...))``: PTX and a
cubin for CUDA, AMDGCN and a code object for ROCm, no GPU needed.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from . import _common

HIDDENS = (64, 123, 896, 4096, 8192, 16384, 32768)  # 123: odd; 32768: past MAX_FUSED, the looped kernels
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOKENS = 8192


@dataclass
class Launch:
    kernel: object  # the @triton.jit function
    grid: tuple
    args: tuple
    kwargs: dict
    op: str = ""

    @property
    def name(self) -> str:
        return self.kernel.__name__

    def key(self) -> tuple:
        """What a compile depends on: the kernel, its arguments' types and specialisation, constexprs
        and options (not the grid, not pointer values)."""
        return (self.name, tuple(_arg_key(a) for a in self.args), tuple(sorted(self.kwargs.items())))

    def describe(self) -> dict:
        return {"kernel": self.name, "op": self.op, "grid": list(self.grid),
                "args": [_arg_key(a) for a in self.args], "kwargs": dict(sorted(self.kwargs.items()))}


def _arg_key(a):
    if isinstance(a, torch.Tensor):
        return "*" + str(a.dtype).removeprefix("torch.")
    if isinstance(a, bool):
        return a
    if isinstance(a, int):  # Triton specialises ints on ==1 and %16 and on their width
        return ("i64" if not -2**31 <= a < 2**31 else "i32", a == 1, a % 16 == 0)
    if isinstance(a, float):
        return "fp32"
    return repr(a)


@contextlib.contextmanager
def recording():
    """Within: every ``Launcher`` call is recorded into the yielded list instead of launched."""
    seen: list[Launch] = []
    original = _common.Launcher.__call__

    def record(self, grid, *args, **kwargs):
        seen.append(Launch(self.fn, tuple(grid), args, dict(kwargs)))

    _common.Launcher.__call__ = record
    try:
        yield seen
    finally:
        _common.Launcher.__call__ = original


def _scenarios(hiddens, dtypes, tokens):
    """(op label, thunk) pairs: each thunk calls one launcher on meta tensors."""
    from . import fp8_quant, gated, layer_norm, linear_cross_entropy as lce, rms_norm, rope

    meta = torch.device("meta")
    for dt in dtypes:
        e = lambda *s, d=dt: torch.empty(*s, dtype=d, device=meta)  # noqa: E731
        f32 = lambda *s: torch.empty(*s, dtype=torch.float32, device=meta)  # noqa: E731
        for n in hiddens:
            x, w, rs = e(tokens, n), e(n), f32(tokens)
            yield "rms_norm_fwd", lambda x=x, w=w: rms_norm.rms_norm_fwd(x, w, 1e-6, 0.0)
            yield "add_rms_norm_fwd", lambda x=x, w=w: rms_norm.add_rms_norm_fwd(x, x, w, 1e-6, 0.0)
            yield "rms_norm_bwd", lambda x=x, w=w, rs=rs: rms_norm.rms_norm_bwd(x, x, w, rs, 1e-6, 0.0)
            yield "rms_norm_bwd+dres", lambda x=x, w=w, rs=rs: rms_norm.rms_norm_bwd(x, x, w, rs, 1e-6, 0.0, x)
            yield "add_rms_norm_bwd", lambda x=x, w=w, rs=rs: rms_norm.add_rms_norm_bwd(
                x, x, w, rs, 1e-6, 0.0, x, torch.bfloat16)
            yield "layer_norm_fwd", lambda x=x, w=w: layer_norm.layer_norm_fwd(x, w, w, 1e-5)
            yield "layer_norm_fwd-bias", lambda x=x, w=w: layer_norm.layer_norm_fwd(x, w, None, 1e-5)
            yield "layer_norm_bwd", lambda x=x, w=w, rs=rs: layer_norm.layer_norm_bwd(x, x, w, w, rs, rs, 1e-5)
            yield "layer_norm_bwd-bias", lambda x=x, w=w, rs=rs: layer_norm.layer_norm_bwd(x, x, w, None, rs, rs, 1e-5)
            # The MLP's gate/up: intermediate ≈ 2.7 × hidden; contiguous (one flat row) and row-strided.
            gu = e(tokens, 2 * n)
            g, u = gu[:, :n], gu[:, n:]
            yield "swiglu_fwd", lambda x=x: gated.swiglu_fwd(x, x)
            yield "swiglu_bwd", lambda x=x: gated.swiglu_bwd(x, x, x)
            yield "geglu_fwd", lambda x=x: gated.geglu_fwd(x, x)
            yield "geglu_bwd", lambda x=x: gated.geglu_bwd(x, x, x)
            yield "swiglu_packed_fwd", lambda gu=gu: gated.swiglu_packed_fwd(gu)
            yield "swiglu_packed_bwd", lambda x=x, gu=gu: gated.swiglu_packed_bwd(x, gu)
            yield "geglu_packed_bwd", lambda x=x, gu=gu: gated.geglu_packed_bwd(x, gu)
            yield "swiglu_fwd-strided", lambda g=g, u=u: gated.swiglu_fwd(g, u)
            yield "gelu_fwd-tanh", lambda x=x: gated.gelu_fwd(x, "tanh")
            yield "gelu_fwd", lambda x=x: gated.gelu_fwd(x, "none")
            yield "gelu_bwd-tanh", lambda x=x: gated.gelu_bwd(x, x, "tanh")
            yield "gelu_bwd", lambda x=x: gated.gelu_bwd(x, x, "none")
            yield "gelu_bwd-strided", lambda g=g: gated.gelu_bwd(g, g, "none")
        for hq, hk, d in ((32, 8, 128), (14, 2, 64), (16, 16, 256)):
            s = tokens // 4
            q, k, cs = e(4, hq, s, d), e(4, hk, s, d), e(1, s, d)
            yield "rope_fwd", lambda q=q, k=k, cs=cs: rope.rope_fwd(q, k, cs, cs)
            yield "rope_bwd", lambda q=q, k=k, cs=cs: rope.rope_bwd(q, k, cs, cs)
        for n, v in ((2048, 128256), (896, 151936), (64, 1000)):
            h, wv, lab = e(tokens, n), e(v, n), torch.empty(tokens, dtype=torch.int64, device=meta)
            yield "lce", lambda h=h, wv=wv, lab=lab: lce.linear_cross_entropy_fwd(
                h, wv, None, lab, -100, None, "mean", True)
            yield "lce+bias+softcap", lambda h=h, wv=wv, lab=lab: lce.linear_cross_entropy_fwd(
                h, wv, wv[:, 0], lab, -100, 30.0, "sum", True)
            yield "lce-nograd", lambda h=h, wv=wv, lab=lab: lce.linear_cross_entropy_fwd(
                h, wv, None, lab, -100, None, "mean", False)
        yield "lce_scale", lambda: lce.linear_cross_entropy_scale_([e(4096, 2048)], f32(()))
    # FP8 GEMM operands (after the rest, so the earlier launches keep their recorded order): x and dy
    # rowwise, dW's dyᵀ and xᵀ written transposed, and tensorwise both ways.
    for dt in dtypes:
        for n in hiddens:
            x = torch.empty(tokens, n, dtype=dt, device=meta)
            for tensorwise in (False, True):
                for transpose in (False, True):
                    label = f"fp8_quantize-{'tensorwise' if tensorwise else 'rowwise'}{'-t' if transpose else ''}"
                    yield label, lambda x=x, tw=tensorwise, tr=transpose: fp8_quant.fp8_quantize(x, tw, tr)
    # MoE (after the FP8 ones, for the same reason): the router both ways and the experts op both ways at
    # the shapes of the models each form comes from, whatever the hiddens asked for.
    from . import moe

    meta = torch.device("meta")
    for dt in dtypes:
        for label, (e, k, h, i, scoring, renorm, corr, act, halves, bias, transposed) in MOE_SHAPES.items():
            f32 = lambda *s: torch.empty(*s, dtype=torch.float32, device=meta)  # noqa: E731
            e_ = lambda *s, d=dt: torch.empty(*s, dtype=d, device=meta)  # noqa: E731
            logits, idx = e_(tokens, e), torch.empty(tokens, k, dtype=torch.int64, device=meta)
            c = f32(e) if corr else None
            yield f"moe_route_fwd-{label}", lambda l=logits, c=c, k=k, sc=scoring, rn=renorm: moe.moe_route_fwd(
                l, c, k, sc, rn, 1, 1, 2, 2.5)
            yield f"moe_route_bwd-{label}", lambda l=logits, idx=idx, sc=scoring, rn=renorm: moe.moe_route_bwd(
                f32(*idx.shape), l, idx, sc, rn, 2.5)
            x, w = e_(tokens, h), f32(tokens, k)
            gu, dn = (e_(e, h, 2 * i), e_(e, i, h)) if transposed else (e_(e, 2 * i, h), e_(e, h, i))
            gub, dnb = (f32(e, 2 * i), f32(e, h)) if bias else (None, None)
            args = (transposed, halves, act, 1.702, 7.0)
            s = tokens * k
            yield f"moe_experts_fwd-{label}", lambda x=x, w=w, idx=idx, gu=gu, gub=gub, dn=dn, dnb=dnb, a=args: \
                moe.moe_experts_fwd(x, w, idx, gu, gub, dn, dnb, *a)
            yield f"moe_experts_bwd-{label}", lambda x=x, w=w, idx=idx, gu=gu, gub=gub, dn=dn, dnb=dnb, a=args, s=s, \
                i=i, e=e: moe.moe_experts_bwd(x, x, w, idx, gu, gub, dn, dnb, e_(s, 2 * i), torch.empty(
                    s, dtype=torch.int64, device=meta), torch.empty(e, dtype=torch.int32, device=meta), *a)
    # An FP8 GEMM operand quantised both ways from two reads (x, dy, the weights; after the MoE ones, for
    # the same reason): rowwise by the atomic both-ways kernels (the switch fp8_rowwise_both = "atomic", the
    # default, recorded under this label first) and tensorwise.
    for dt in dtypes:
        for n in hiddens:
            x = torch.empty(tokens, n, dtype=dt, device=meta)
            for tensorwise in (False, True):
                label = f"fp8_quantize_both-{'tensorwise' if tensorwise else 'rowwise'}"
                yield label, lambda x=x, tw=tensorwise: _rowwise_both("atomic", fp8_quant.fp8_quantize_both, x, tw)
    # Rowwise both ways by the rows kernel writing column partials + the transposed tiles kernel (after
    # all the others, for the same reason).
    for dt in dtypes:
        for n in hiddens:
            x = torch.empty(tokens, n, dtype=dt, device=meta)
            yield "fp8_quantize_both-rowwise-rows+tiles", lambda x=x: _rowwise_both(
                "rows+tiles", fp8_quant.fp8_quantize_both, x, False)
    # Blockwise FP8 (after all the others, for the same reason): an activation rows only (x, dy for the
    # forward's and dx's GEMMs), columns only (dW's operands alone), both ways, and a weight's 128 × 128
    # blocks, at the hiddens that are multiples of 128 (the recipe's shapes; others are refused).
    from . import fp8_blocks

    for dt in dtypes:
        for n in (n for n in hiddens if n % fp8_blocks.BLOCK == 0):
            x = torch.empty(tokens, n, dtype=dt, device=meta)
            for ways, rows, cols in (("rows", True, False), ("cols", False, True), ("rows+cols", True, True)):
                yield f"fp8_quantize_blocks-{ways}", lambda x=x, r=rows, c=cols: fp8_blocks.fp8_quantize_blocks(x, r, c)
            yield "fp8_quantize_weight_blocks", lambda w=x: fp8_blocks.fp8_quantize_weight_blocks(w)
    # The FP8 producers (after all the others, for the same reason): the packed activations taking their
    # outputs' maxima forward and backward (gated_fp8.py), and the both-ways writer from those maxima.
    from . import gated_fp8

    for dt in dtypes:
        for n in hiddens:
            gu, x = torch.empty(tokens, 2 * n, dtype=dt, device=meta), torch.empty(tokens, n, dtype=dt, device=meta)
            for act in ("swiglu", "geglu"):
                yield f"{act}_packed_fp8_fwd", lambda gu=gu, a=act: getattr(gated_fp8, f"{a}_packed_fp8_fwd")(gu)
                yield f"{act}_packed_fp8_bwd", lambda x=x, gu=gu, a=act: getattr(gated_fp8, f"{a}_packed_fp8_bwd")(x, gu)
            amax = torch.empty(tokens + n, dtype=torch.int32, device=meta)
            yield "fp8_quantize_both_amax", lambda x=x, amax=amax: fp8_quant.fp8_quantize_both_amax(x, amax)
    # The norms as FP8 producers (norm_fp8.py; after all the others, for the same reason): bf16 outputs,
    # the only ones that take maxima, from an fp32 residual stream (autocast) or bf16 rows.
    from . import norm_fp8

    bf = torch.bfloat16
    for dt in (d for d in dtypes if d in (torch.float32, bf)):
        for n in hiddens:
            x, w, rs = (torch.empty(*s, dtype=d, device=meta) for s, d in (((tokens, n), dt), ((n,), dt),
                                                                           ((tokens,), torch.float32)))
            yield "rms_norm_fp8_fwd", lambda x=x, w=w: norm_fp8.rms_norm_fp8_fwd(x, w, 1e-6, 0.0, bf)
            yield "add_rms_norm_fp8_fwd", lambda x=x, w=w: norm_fp8.add_rms_norm_fp8_fwd(x, x, w, 1e-6, 0.0, bf)
            yield "rms_norm_fp8_bwd+dres", lambda x=x, w=w, rs=rs: norm_fp8.rms_norm_fp8_bwd(x, x, w, rs, 1e-6, 0.0, x)
            yield "add_rms_norm_fp8_bwd", lambda x=x, w=w, rs=rs: norm_fp8.add_rms_norm_fp8_bwd(
                x, x, w, rs, 1e-6, 0.0, x, bf)
    # Residual adds inside LayerNorm (LayerNorm decoder layers), exact-GELU gating, and the 4-bit
    # dequantisation of QLoRA bases (after all the others, for the same reason).
    from . import dequant_4bit

    for dt in dtypes:
        e = lambda *s, d=dt: torch.empty(*s, dtype=d, device=meta)  # noqa: E731
        for n in hiddens:
            x, w, rs = e(tokens, n), e(n), torch.empty(tokens, dtype=torch.float32, device=meta)
            yield "add_layer_norm_fwd", lambda x=x, w=w: layer_norm.add_layer_norm_fwd(x, x, w, w, 1e-5)
            yield "layer_norm_res_bwd", lambda x=x, w=w, rs=rs: layer_norm.layer_norm_res_bwd(x, x, w, w, rs, rs, 1e-5, x)
            gu = e(tokens, 2 * n)
            yield "geglu_erf_fwd", lambda x=x: gated.geglu_erf_fwd(x, x)
            yield "geglu_erf_bwd", lambda x=x: gated.geglu_erf_bwd(x, x, x)
            yield "geglu_erf_packed_fwd", lambda gu=gu: gated.geglu_erf_packed_fwd(gu)
            yield "geglu_erf_packed_bwd", lambda x=x, gu=gu: gated.geglu_erf_packed_bwd(x, gu)
        for hq, hk, d, r in ((32, 8, 128, 64), (32, 8, 80, 32)):  # partial rotary (NeoX's rotary_pct, Phi's factor)
            q, k, cs = e(4, hq, tokens // 4, d), e(4, hk, tokens // 4, d), e(1, tokens // 4, r)
            yield "rope_fwd-partial", lambda q=q, k=k, cs=cs: rope.rope_fwd(q, k, cs, cs)
            yield "rope_bwd-partial", lambda q=q, k=k, cs=cs: rope.rope_bwd(q, k, cs, cs)
        rows, cols = 4096, 4096
        packed = torch.empty(rows * cols // 2, 1, dtype=torch.uint8, device=meta)
        absmax, code = torch.empty(rows * cols // 64, device=meta), torch.empty(16, device=meta)
        yield "dequantize_4bit_fwd", lambda p=packed, a=absmax, c=code, d=dt: dequant_4bit.dequantize_4bit_fwd(
            p, a, c, 64, rows, cols, d)
    # The GEMM that dequantises its 4-bit weight tile by tile (off by default, NOTES-qlora.md): llama8b's gate/up
    # [28672 × 4096] forward at 4096 tokens, and its down [4096 × 14336] backward (after all the others).
    from . import dequant_matmul_4bit as dqmm

    for dt in dtypes:
        for rows, cols, fwd in ((28672, 4096, True), (4096, 14336, False)):
            packed = torch.empty(rows * cols // 2, 1, dtype=torch.uint8, device=meta)
            absmax, code = torch.empty(rows * cols // 64, device=meta), torch.empty(16, device=meta)
            a = torch.empty(tokens // 2, cols if fwd else rows, dtype=dt, device=meta)
            fn = dqmm.dequant_matmul_4bit_fwd if fwd else dqmm.dequant_matmul_4bit_bwd
            yield fn.__name__, lambda a=a, p=packed, s=absmax, c=code, d=dt, f=fn, r=rows, k=cols: f(
                a, p, s, c, 64, r, k, d)
    # The fused LoRA node's hi/lo operand splits (bf16 base, fp32 adapters), after all the others: the
    # q/k/v A's stacked [hi; lo], s·h as [hi | lo | hi] (a column slice, scaled), a B as [hi | hi | lo], dh.
    from .hilo_split import hilo_split

    f32 = lambda *s: torch.empty(*s, dtype=torch.float32, device=meta)  # noqa: E731
    r, d = 16, 4096
    for t, parts, dim, scale in ((f32(3 * r, d), "hl", 0, 1.0), (f32(tokens, 3 * r)[:, r:2 * r], "hlh", 1, 2.0),
                                 (f32(d, r), "hhl", 1, 1.0), (f32(tokens, 3 * r), "hlh", 1, 1.0)):
        yield "hilo_split", lambda t=t, p=parts, dm=dim, s=scale: hilo_split(t, p, dm, torch.bfloat16, s)
    # The plain MLP's ReLU and squared ReLU (Nemotron, Persimmon, CTRL), after all the others.
    from . import activation

    for dt in dtypes:
        for n in hiddens:
            x = torch.empty(tokens, 4 * n, dtype=dt, device=meta)
            for kind in ("relu", "relu2"):
                yield f"activation_fwd-{kind}", lambda x=x, k=kind: activation.activation_fwd(x, k)
                yield f"activation_bwd-{kind}", lambda x=x, k=kind: activation.activation_bwd(x, x, k)
    # Double quantisation's block scales of a QLoRA base (llama8b's gate/up: 28672 × 4096 / 64), after all the others.
    n = 28672 * 4096 // 64
    q, a2 = torch.empty(n, dtype=torch.uint8, device=meta), torch.empty(n // 256, device=meta)
    code2, off = torch.empty(256, device=meta), torch.empty((), device=meta)
    yield "dequantize_scales_fwd", lambda: dequant_4bit.dequantize_scales_fwd(q, a2, code2, 256, off)
    # Norm then add (post-block norms, OLMo-2), after all the others: a block's output and the residual stream in
    # one dtype, and under autocast (a bf16/fp16 output, an fp32 stream; the norm in a's dtype or, by Llama's rule
    # as EXAONE 4's, in fp32); the backward's rms_norm_bwd of dy in y's dtype.
    from . import rms_norm_add

    for dt in dtypes:
        for n in hiddens:
            a, w = torch.empty(tokens, n, dtype=dt, device=meta), torch.empty(n, dtype=dt, device=meta)
            r32, rs = torch.empty(tokens, n, device=meta), torch.empty(tokens, device=meta)
            yield "rms_norm_add_fwd", lambda a=a, w=w: rms_norm_add.rms_norm_add_fwd(a, a, w, 1e-6, 0.0)
            yield "rms_norm_add_bwd", lambda a=a, w=w, rs=rs: rms_norm_add.rms_norm_add_bwd(a, a, w, rs, 1e-6, 0.0)
            if dt != torch.float32:
                for yd in (None, torch.float32):
                    yield "rms_norm_add_fwd-autocast", lambda a=a, r=r32, w=w, yd=yd: rms_norm_add.rms_norm_add_fwd(
                        a, r, w, 1e-6, 0.0, yd)
                yield "rms_norm_add_bwd-fp32y", lambda a=a, r=r32, w=w, rs=rs: rms_norm_add.rms_norm_add_bwd(
                    r, a, w, rs, 1e-6, 0.0, torch.float32)


def _rowwise_both(path, fn, *args):
    """fn(*args) with the switch fp8_rowwise_both = path."""
    from torchfuser.switches import switched

    with switched(fp8_rowwise_both=path):
        return fn(*args)


# Label → (experts, top-k, hidden, intermediate, scoring, renorm, correction, activation, halves, biases,
# transposed): every constexpr variant of the MoE kernels at least once.
MOE_SHAPES = {
    "mixtral": (8, 2, 4096, 14336, "softmax", True, False, "silu", "gate_up", False, False),
    "olmoe+gelu_tanh+up_gate": (64, 8, 2048, 1024, "softmax", False, False, "gelu_tanh", "up_gate", False, False),
    "deepseek_v3-ungrouped": (256, 8, 7168, 2048, "sigmoid", True, True, "silu", "gate_up", False, False),
    "gpt_oss": (32, 4, 2880, 2880, "softmax_topk", False, False, "clamped_swiglu", "interleaved", True, True),
}


def record_launches(hiddens=HIDDENS, dtypes=DTYPES, tokens=TOKENS, unique=True) -> list[Launch]:
    """The launches the backend's launchers make for the representative shapes (see module doc)."""
    out, keys = [], set()
    for op, thunk in _scenarios(hiddens, dtypes, tokens):
        with recording() as seen, _gpu_gemm_answers():
            thunk()
        for launch in seen:
            launch.op = op
            if unique:
                k = launch.key()
                if k in keys:
                    continue
                keys.add(k)
            out.append(launch)
    return out


@contextlib.contextmanager
def _gpu_gemm_answers():
    """Within: the fp32-output GEMM probe answers for meta tensors as a GPU with this PyTorch does (the
    overload runs on CUDA and ROCm), not as this PyTorch's meta kernels do (2.11 has none for it), so
    the recorded LCE backward is the one a GPU launches whatever PyTorch records it."""
    from .. import _gemm

    meta = torch.device("meta")
    had, old = meta in _gemm._OUT_DTYPE, _gemm._OUT_DTYPE.get(meta)
    _gemm._OUT_DTYPE[meta] = True
    try:
        yield
    finally:
        if had:
            _gemm._OUT_DTYPE[meta] = old
        else:
            del _gemm._OUT_DTYPE[meta]


_BINDERS: dict = {}  # (kernel, backend, arch) -> (backend object, Triton's binder)


def _binder(kernel, gpu_target):
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    key = (kernel, gpu_target.backend, gpu_target.arch)
    if key not in _BINDERS:
        backend = make_backend(gpu_target)
        _BINDERS[key] = (backend, create_function_from_signature(kernel.signature, kernel.params, backend))
    return _BINDERS[key]


def compile_launch(launch: Launch, gpu_target):
    """The ``CompiledKernel`` Triton would build for ``launch`` on ``gpu_target`` (a
    ``triton.backends.compiler.GPUTarget``): signature, constexprs and ``tt.divisibility``
    attributes from Triton's own binder for that target's backend, options as ``JITFunction.run``
    parses them. Meta tensors have a null data pointer: aligned, as a real allocation is."""
    import triton

    backend, binder = _binder(launch.kernel, gpu_target)
    bound, specialization, _ = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = launch.kernel._pack_args(
        backend, dict(launch.kwargs), bound, specialization, None)
    src = triton.compiler.ASTSource(launch.kernel, signature, constexprs, attrs)
    return triton.compile(src, target=gpu_target, options=options.__dict__)


def _nvidia_tool(name: str) -> str:
    import os

    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _int(pattern: str, text: str, default=None):
    import re

    m = re.search(pattern, text)
    return int(m.group(1)) if m else default


def resources(compiled, target) -> dict:
    """Registers, spills, shared memory and an occupancy estimate of one compiled kernel.

    NVIDIA: the cubin Triton built, read by the bundled ``cuobjdump -res-usage`` (REG, LOCAL =
    spilled bytes a thread), and ``ptxas -v`` on the same PTX for the spill stores it reports.
    AMD: the AMDGCN text's metadata (``.vgpr_count``, ``.agpr_count``, ``.sgpr_count``,
    ``.vgpr_spill_count``, ``.sgpr_spill_count``, ``.group_segment_fixed_size``) and LLVM's own
    ``; Occupancy:`` (waves per SIMD, of 8). Shared memory: Triton's ``metadata.shared``
    (dynamic shared memory / LDS a program allocates)."""
    import os
    import subprocess
    import tempfile

    md = compiled.metadata
    warps = md.num_warps
    out = {"num_warps": warps, "num_stages": md.num_stages, "shared": md.shared,
           "threads": warps * target.warp_size}
    if target.backend == "hip":
        a = compiled.asm["amdgcn"]
        out.update(
            vgprs=_int(r"\.vgpr_count:\s+(\d+)", a), agprs=_int(r"\.agpr_count:\s+(\d+)", a, 0),
            sgprs=_int(r"\.sgpr_count:\s+(\d+)", a),
            spills=_int(r"\.vgpr_spill_count:\s+(\d+)", a, 0) + _int(r"\.sgpr_spill_count:\s+(\d+)", a, 0),
            scratch=_int(r"\.private_segment_fixed_size:\s+(\d+)", a, 0),
            lds=_int(r"\.group_segment_fixed_size:\s+(\d+)", a, 0),
        )
        waves = _int(r"; Occupancy:\s+(\d+)", a)
        out["occupancy"] = None if waves is None else round(waves / 8, 3)
        return out
    with tempfile.TemporaryDirectory() as d:
        cubin, ptx = os.path.join(d, "k.cubin"), os.path.join(d, "k.ptx")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        res = subprocess.run([_nvidia_tool("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True,
                             check=True).stdout
        arch = f"sm_{target.arch}a" if target.arch == 90 else f"sm_{target.arch}"
        v = subprocess.run([_nvidia_tool("ptxas"), "-v", f"--gpu-name={arch}", ptx, "-o", os.path.join(d, "v.cubin")],
                           capture_output=True, text=True, check=True).stderr
    regs = _int(r"REG:(\d+)", res)
    out.update(regs=regs, local=_int(r"LOCAL:(\d+)", res, 0), stack=_int(r"STACK:(\d+)", res, 0),
               spills=_int(r"(\d+) bytes spill stores", v, 0) + _int(r"(\d+) bytes spill loads", v, 0))
    # Resident programs an SM: warps, registers (65536 a SM, allocated per warp in units of 256),
    # shared memory (plus the 1 KiB the driver reserves a block), at most 32 blocks.
    per_warp = -(-regs * 32 // 256) * 256 if regs else 0
    by_regs = 65536 // (per_warp * warps) if per_warp else 32
    by_smem = target.smem_per_sm // (md.shared + 1024)
    blocks = max(0, min(32, target.max_warps_per_sm // warps, by_regs, by_smem))
    out["occupancy"] = round(blocks * warps / target.max_warps_per_sm, 3)
    return out
