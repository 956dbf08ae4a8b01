"""``@torchfuser.jit``: compile a function or module on its first call, reuse it afterwards.

    @torchfuser.jit                              # or @torchfuser.jit(backend="mlir", dynamic=True)
    def gated(x, w, b): ...

    fast = torchfuser.jit(model)                 # a module: its parameters are used as they are
    fast.explain(x)                              # regions, rewrites, graphs/MLIR per stage

Built on ``torch.compile`` with the torchfuser Dynamo backend. ``dynamic=False`` compiles once
per distinct input signature; ``dynamic=True`` keeps the leading dims of every tensor argument
symbolic (the last dim, the feature size, stays static: kernels specialise on it).
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from torchfuser.compiler.backend import dynamo_backend
from torchfuser.compiler.options import parse


def _mark_leading_dynamic(args) -> None:
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() >= 2:
            for d in range(a.dim() - 1):
                torch._dynamo.maybe_mark_dynamic(a, d)


class Jitted:
    """A compiled function or module. ``records`` holds one CompileRecord per compilation."""

    def __init__(self, target, *, fullgraph: bool = False, **options):
        self.target = target
        self.options = parse(**options)
        self.fullgraph = fullgraph
        self.records: list = []
        self._compiled = self._make(self.records)
        functools.update_wrapper(self, target.forward if isinstance(target, nn.Module) else target, updated=())

    def _make(self, sink: list):
        backend = functools.partial(dynamo_backend, _sink=sink, **_as_kwargs(self.options))
        # dynamic=True: we mark leading dims ourselves; False: every new shape is a new signature.
        dynamic = False if self.options.dynamic is False else None
        return torch.compile(self.target, backend=backend, dynamic=dynamic, fullgraph=self.fullgraph)

    @property
    def compile_count(self) -> int:
        """How many graphs were compiled (a recompile for a new signature adds one)."""
        return len(self.records)

    def __call__(self, *args, **kwargs):
        if self.options.dynamic:
            _mark_leading_dynamic(args)
        return self._compiled(*args, **kwargs)

    def __getattr__(self, name):
        # a jitted module still exposes its parameters, train()/eval(), state_dict(), ...
        if name == "target":
            raise AttributeError(name)
        return getattr(self.target, name)

    def explain(self, *args, backward: bool = True, print_: bool = True, **kwargs):
        """Compile afresh on ``args``, run the forward (and, if anything requires grad, a
        backward that leaves every ``.grad`` untouched) and return the records: regions, what was
        rewritten, and each region's MLIR per stage (or its FX code when no dumps are exposed)."""
        from torchfuser.compiler.explain import Explanation

        sink: list = []
        fn = self._make(sink)
        if self.options.dynamic:
            _mark_leading_dynamic(args)
        out = fn(*args, **kwargs)
        if backward:
            outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor) and o.requires_grad]
            leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
            if isinstance(self.target, nn.Module):
                leaves += [p for p in self.target.parameters() if p.requires_grad]
            if outs and leaves:
                torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs], allow_unused=True)
        result = Explanation(sink)
        if print_:
            print(result)
        return result


def _as_kwargs(opts) -> dict:
    from dataclasses import asdict

    return asdict(opts)


def jit(fn=None, /, *, backend: str = "auto", dynamic: bool = False, rewrite="auto", kernels: str = "auto",
        fullgraph: bool = False):
    """Compile ``fn`` (a function or an ``nn.Module``) with TorchFuser on its first call.

    backend: "auto" (MLIR regions on the CPU, Inductor on CUDA), "mlir", "inductor" or "eager".
    dynamic: False recompiles once per new input signature; True keeps leading dims symbolic.
    rewrite: "auto" (fused ops where a compiled kernel exists), True (always) or False.
    kernels: the kernel backend rewritten ops call ("auto", "reference", "triton", "mlir").
    """
    def wrap(target):
        if not callable(target):
            raise TypeError(f"torchfuser.jit expects a function or an nn.Module, got {type(target).__name__}")
        return Jitted(target, backend=backend, dynamic=dynamic, rewrite=rewrite, kernels=kernels, fullgraph=fullgraph)

    return wrap if fn is None else wrap(fn)
