"""A compiled row kernel bound to its signature: allocate outputs, run, finish sums."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import memory, runner
from .capture import ROW, Captured
from .jit import Loaded


@dataclass
class Kernel:
    cap: Captured
    loaded: Loaded
    info: dict

    def __call__(self, *inputs: torch.Tensor, out: list | None = None) -> list[torch.Tensor]:
        """``inputs`` as (rows, *row_shape) for row args and exact shapes for broadcast args.

        Returns the outputs: row outputs (rows, *row_shape), sum outputs in their final dtype.
        ``out`` may give, per output, a (rows, *row_shape) view with inner stride 1 to write
        a row output into (e.g. a permuted view of a larger contiguous tensor); None entries
        are allocated here, contiguous.
        """
        cap = self.cap
        n = None
        ins = []
        for t, a in zip(inputs, cap.args):
            if t.dtype != a.dtype:
                raise TypeError(f"{cap.name}: expected {a.dtype}, got {t.dtype}")
            if a.role == ROW:
                n = t.shape[0] if n is None else n
                if t.shape[0] != n or tuple(t.shape[1:]) != a.shape:
                    raise ValueError(f"{cap.name}: row input of shape {tuple(t.shape)} does not match ({n}, {a.shape})")
                if a.shape and t.stride(-1) != 1:
                    t = t.contiguous()
                elif not a.shape and t.stride(0) != 1:
                    t = t.contiguous()
            else:
                if tuple(t.shape) != a.shape:
                    raise ValueError(f"{cap.name}: input of shape {tuple(t.shape)}, expected {a.shape}")
                if a.shape and t.stride(-1) != 1:
                    t = t.contiguous()
            ins.append(t)
        row_elems = 1
        for d in next((a.shape for a in cap.args if a.role == ROW), ()):
            row_elems *= d
        plan = runner.plan(n, row_elems)
        outs = []
        for j, (role, shape, dtype) in enumerate(zip(cap.out_roles, cap.out_shapes, cap.out_dtypes)):
            given = None if out is None else out[j]
            if given is not None:
                outs.append(given)
            elif role == ROW:
                outs.append(memory.empty((n, *shape), dtype))
            else:
                outs.append(torch.empty((plan.blocks, *shape), dtype=torch.float32))
        call = runner.Call(self.loaded.fn, tuple(a.role for a in cap.args) + cap.out_roles, len(ins))
        if n > 0:
            runner.run(call, n, ins, outs, plan)
        else:
            for o, role in zip(outs, cap.out_roles):
                if role != ROW:
                    o.zero_()
        result = []
        for o, role, final in zip(outs, cap.out_roles, cap.final_dtypes):
            if role != ROW:
                o = o[0] if plan.blocks == 1 else o.sum(0)
                o = o.to(final)
            result.append(o)
        return result
