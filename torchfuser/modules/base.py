"""What every fused module shares: the spec it was built from and the backend it asks for."""
from __future__ import annotations

import contextlib
import sys
import threading

import torch
from torch import nn

class _Graphing(threading.local):
    on = False  # (a class default: a read on a thread that never set it raises no AttributeError inside getattr)


_graphing = _Graphing()


@contextlib.contextmanager
def no_host_reads():
    """While CUDA graphs are warmed up and captured: forward code must not branch on tensor
    values read back to the host (a capture cannot, and the graph would replay one branch)."""
    before, _graphing.on = getattr(_graphing, "on", False), True
    try:
        yield
    finally:
        _graphing.on = before


def host_reads_allowed() -> bool:
    return not (torch.compiler.is_compiling() or _graphing.on)


class FusedModule(nn.Module):
    """Base of every module TorchFuser swaps in. Holds the original parameters and submodules
    under their original names, so ``state_dict`` keys and values do not change."""

    def __init__(self, spec, backend: str):
        super().__init__()
        self.spec = spec
        self.backend = None if backend == "auto" else backend

    def extra_repr(self) -> str:
        return f"spec={self.spec}, backend={self.backend or 'auto'}"

    def __getattr__(self, name: str):
        """What this module does not hold or define itself, read from the module it replaced
        (``Pattern.build`` keeps it as ``_original``, outside ``_modules``: no state_dict key, no
        second visit by ``.to()``): model code reads its children's config, eps, sizes and flags
        (Mamba2 passes ``self.norm.variance_epsilon`` to its kernel), and must get what it got."""
        d = self.__dict__  # parameters, buffers, submodules: nn.Module's lookup, one Python frame less a read
        store = d.get("_parameters")  # (absent while a copy or unpickling is being built)
        if store is not None and name in store:  # (unrolled, not a loop over the three: host time)
            return store[name]
        store = d.get("_modules")
        if store is not None and name in store:
            return store[name]
        store = d.get("_buffers")
        if store is not None and name in store:
            return store[name]
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self.__dict__.get("_original")
            if original is None or name.startswith("__"):  # copy/pickle protocol probes stay misses
                raise
            # Its tensors are only those this module adopted: one it does not hold (FSDP1 took the
            # parameter away to flatten it) must read as absent, not as the original's stale object.
            if name in original._parameters or name in original._buffers:
                raise
        try:
            return getattr(original, name)
        except AttributeError:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}', "
                                 f"nor has the {type(original).__name__} it replaced") from None


def decided(module: nn.Module, key: tuple, decide):
    """``decide()`` once per ``key`` for ``module``: a fused call's input checks and backend choice, made once
    per call signature instead of per call (host time: a decode step calls every fused module once a token).
    The key must hold everything ``decide`` reads (types, dtypes, devices, shapes, the module's backend, ...);
    a ``decide`` that raises stores nothing, so an invalid call raises every time. At most 64 signatures a
    module are kept (varying lengths): past that, decided per call."""
    if torch.compiler.is_compiling():  # traced: decided in the trace (a key of symbolic shapes is no dict key)
        return decide()
    memo = module.__dict__.get("_decisions")
    if memo is None:
        memo = module.__dict__["_decisions"] = {}
    found = memo.get(key)
    if found is None:
        found = decide()
        if len(memo) < 64:
            memo[key] = found
    return found


def signature(t) -> tuple:
    """What a fused op's checks read of a tensor argument (None stays None)."""
    return None if t is None else (type(t), t.dtype, t.device, t.shape)


_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


_MODULE = nn.modules.module


def hooked(*modules: nn.Module) -> bool:
    """Whether calling these modules runs hooks (their own or global ones): then code that calls their
    weights directly, not the modules, would skip them."""
    # Loops, not generators: every fused decoder layer's call asks (host time of a decode step).
    if (_MODULE._global_forward_hooks or _MODULE._global_forward_pre_hooks or _MODULE._global_backward_hooks
            or _MODULE._global_backward_pre_hooks):
        return True
    for m in modules:
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
            return True
    return False


def callee(module: nn.Module):
    """What calling ``module`` runs: its bound ``forward`` where ``module(...)`` would run just that (no hooks of its
    own or global ones, none on the instance, no JIT trace in progress), else the module itself. A fused layer calls
    its fused blocks so: ``nn.Module.__call__`` costs ≈ 1.4 µs a call (host time of a decode step)."""
    if (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
            or _MODULE._global_forward_hooks or _MODULE._global_forward_pre_hooks or _MODULE._global_backward_hooks
            or _MODULE._global_backward_pre_hooks or torch._C._get_tracing_state()):
        return module
    return module.forward


def adopt(fused: nn.Module, original: nn.Module, names) -> None:
    """Register ``original``'s parameters, buffers and submodules ``names`` on ``fused`` as the
    same objects under the same names, in the original's order (no copies; ``state_dict`` keys
    and ``parameters()`` come out as before)."""
    wanted = set(names)
    for name, param in original._parameters.items():
        if name in wanted:
            fused.register_parameter(name, param)
    for name, buf in original._buffers.items():
        if name in wanted:
            fused.register_buffer(name, buf, persistent=name not in original._non_persistent_buffers_set)
    for name, child in original._modules.items():
        if name in wanted:
            fused.add_module(name, child)
    missing = wanted - set(original._parameters) - set(original._buffers) - set(original._modules)
    if missing:
        raise AttributeError(f"{type(original).__name__} has no parameter, buffer or submodule {sorted(missing)}")


def keep_dropout(fused: nn.Module, original: nn.Module, name: str | None) -> str | None:
    """A dropout the fused module applies where the original did: an ``nn.Dropout`` child (returned,
    to be adopted) or a float attribute holding p, which the original passes to a functional
    dropout (copied here; None is returned)."""
    if name is None:
        return None
    value = getattr(original, name)
    if isinstance(value, nn.Module):
        return name
    setattr(fused, name, float(value))
    return None


def dropout_p(module: nn.Module, name: str | None) -> float:
    """The probability the dropout ``name`` (an nn.Dropout child or a float attribute) applies now:
    0 without one or outside training."""
    if name is None or not module.training:
        return 0.0
    drop = getattr(module, name)
    return float(drop.p if isinstance(drop, nn.Module) else drop)


def apply_dropout(module: nn.Module, name: str | None, x):
    if name is None:
        return x
    drop = getattr(module, name)
    return drop(x) if isinstance(drop, nn.Module) else nn.functional.dropout(x, drop, module.training)


def hand_back(fused: nn.Module, original: nn.Module) -> None:
    """Give ``original`` whatever ``fused`` now holds under the adopted names: after ``.to()``,
    re-tying or a swapped child, the original must see the current objects, not stale ones."""
    for name, param in fused._parameters.items():
        original._parameters[name] = param
    for name, buf in fused._buffers.items():
        original._buffers[name] = buf
    for name, child in fused._modules.items():
        original._modules[name] = child
    original.training = fused.training  # not .train(): the children are shared and already set


def call_original(fused: nn.Module, *args, **kwargs):
    """The original module ``fused`` replaced (kept as ``fused.__dict__["_original"]``), called on whatever
    ``fused`` now holds (``hand_back``): a call-time fallback."""
    original = fused.__dict__["_original"]
    hand_back(fused, original)
    return original(*args, **kwargs)


def loaded_fsdp():
    """``torch.distributed.fsdp`` if something imported it, else None: then no model can be wrapped
    or sharded by it, and importing it only to check would cost 0.5 s."""
    return sys.modules.get("torch.distributed.fsdp")


_REPLICATE = "_replicate_for_data_parallel"


class _FollowReplicas:
    """``module._replicate_for_data_parallel`` that hands each new replica to ``rebind``. An object
    with attributes, not a closure, so that a deep copy of the model follows its own replicas."""

    def __init__(self, module: nn.Module, rebind, previous):
        self.module, self.rebind, self.previous = module, rebind, previous

    def __call__(self) -> nn.Module:
        if self.previous is not None:
            replica = self.previous()
        else:
            replica = type(self.module)._replicate_for_data_parallel(self.module)
        replica.__dict__.pop(_REPLICATE, None)  # replicas are not replicated again
        self.rebind(replica)
        return replica


def follow_replicas(module: nn.Module, rebind) -> None:
    """nn.DataParallel builds a replica per GPU with a copy of ``module.__dict__`` on every call, so
    anything TorchFuser put in the instance's ``__dict__`` (a fused ``forward``) would still act on
    the original. From now on each new replica is handed to ``rebind(replica)`` first (a bound
    method, so that a deep copy of the model rebinds with its own copy)."""
    module.__dict__[_REPLICATE] = _FollowReplicas(module, rebind, module.__dict__.get(_REPLICATE))


def unfollow_replicas(module: nn.Module) -> None:
    current = module.__dict__.pop(_REPLICATE, None)
    if isinstance(current, _FollowReplicas) and current.previous is not None:
        module.__dict__[_REPLICATE] = current.previous
