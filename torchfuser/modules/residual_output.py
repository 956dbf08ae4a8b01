"""A post-norm output sublayer with its residual add fused into its norm (BERT's ``BertSelfOutput`` / ``BertOutput``
and the many encoders built like it: RoBERTa, ELECTRA, XLM-R, CamemBERT, ERNIE, ...):

    out = norm(dropout(dense(h)) + r)        h: the block's output before its projection, r: the sublayer's residual

``dense`` and ``dropout`` are called as the original calls them (hooks, adapters and the random stream as they
were); the add and the norm run as one kernel forward and one backward (``FusedLayerNorm.add`` /
``FusedRMSNorm.add``: the sum is not needed afterwards, so only the norm's gradient flows back through it, to
both addends). Unfused, the add is a kernel of its own over the hidden states.

The sublayer keeps its class, children and parameters: only its ``forward`` is replaced, on the instance. Calls
with other arguments, norms no longer fused or hooked, and traced code run the original forward (counted with the
reason, ``modules.fallbacks``; traced ones not). Under ``optimize(checkpointing=...)`` the sublayer checkpoints
itself as the fused decoder layers do (``modules.offload``).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from torchfuser.modules import decode, fallbacks, offload
from torchfuser.modules._layer_blocks import child, unfused_norms
from torchfuser.modules.base import follow_replicas, unfollow_replicas


@dataclass(frozen=True)
class ResidualOutputSpec:
    """``names``: its forward's two parameters (the block's output, the residual). ``norm_in`` = ``norm_mid``: the
    norm (the names the walker reads for the children a fused block needs fused)."""

    names: tuple[str, str]
    dense: str
    norm_in: str
    dropout: str | None = None

    @property
    def norm_mid(self) -> str:
        return self.norm_in


class ResidualOutputForward:
    """``module.forward`` of a fused output sublayer; an object, so that a model saved whole keeps it."""

    def __init__(self, module: nn.Module, spec: ResidualOutputSpec):
        self.module, self.spec = module, spec

    def __call__(self, *args, **kwargs):
        m, s = self.module, self.spec
        if not torch.is_grad_enabled():  # a decode step: the unfused sublayer (modules.decode)
            out = decode.layer_call(m, args, kwargs, s.names[0])
            if out is not decode.NOT_DECODE:
                return out
        if torch.compiler.is_compiling():  # Inductor fuses the add into its own norm kernel
            return type(m).forward(m, *args, **kwargs)
        h, r, why = self._inputs(args, kwargs)
        why = why or unfused_norms(child(m, s.norm_in))
        if why is not None:
            fallbacks.count(m, why)
            return type(m).forward(m, *args, **kwargs)
        own = m.__dict__.get(offload.KEY)
        if own is not None and own.applies(m):  # optimize(checkpointing=...): its input kept, the rest made again
            return own.run(partial(self._fused, r=r), h)
        return self._fused(h, r)

    def _inputs(self, args, kwargs):
        """(h, r, None), or (None, None, why the original runs)."""
        first, second = self.spec.names
        if len(args) + len(kwargs) != 2:
            return None, None, "arguments other than its two tensors"
        h = args[0] if args else kwargs.get(first)
        r = args[1] if len(args) > 1 else kwargs.get(second)
        if not (isinstance(h, torch.Tensor) and isinstance(r, torch.Tensor)):
            return None, None, "arguments other than its two tensors"
        return h, r, None

    def _fused(self, h: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        m, s = self.module, self.spec
        y = child(m, s.dense)(h)
        if s.dropout is not None:
            y = child(m, s.dropout)(y)
        norm = child(m, s.norm_in)
        if y.shape != r.shape:  # a broadcasting sum: the kernel adds equal shapes; the original's add, then the norm
            return norm(y + r)
        return norm.add(y, r)[1]

    def rebind(self, replica: nn.Module) -> None:
        """An nn.DataParallel replica gets a forward of its own (it holds the replica's parameters)."""
        replica.__dict__["forward"] = ResidualOutputForward(replica, self.spec)


def install(module: nn.Module, spec: ResidualOutputSpec) -> None:
    fused = ResidualOutputForward(module, spec)
    module.__dict__["forward"] = fused
    follow_replicas(module, fused.rebind)


@dataclass
class Uninstall:
    """Undo of ``install``: the class's forward again."""

    module: nn.Module

    def __call__(self) -> None:
        if isinstance(self.module.__dict__.get("forward"), ResidualOutputForward):
            del self.module.__dict__["forward"]
        self.module.__dict__.pop(offload.KEY, None)
        fallbacks.clear(self.module)
        decode.clear(self.module)
        unfollow_replicas(self.module)
