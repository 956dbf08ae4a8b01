"""How the ops reach their kernels: through the custom op where the dispatcher is needed
(torch.compile, tracing, dispatch modes, tensor subclasses), straight otherwise (``autograd``,
``run``), and with the right dispatch keys from inside a custom op's implementation (``kernel``).
Under torch.compile an elementwise op may instead reach Inductor as its definition, for Inductor
to fuse with its neighbours (``inductor_fuses``).

When a ``TorchDispatchMode`` is active (torch.compile's AOT runtime runs the first call of every
compiled graph under one that checks custom-op aliasing; FlopCounterMode and debug modes do the
same), PyTorch redispatches the op to its implementation with every dispatch key above Python
excluded, functorch's and ADInplaceOrView's included. A kernel that differentiates with
``torch.func`` (the reference backend derives its backward that way) then fails with "Cannot
access storage of TensorWrapper". Those keys are restored for the kernel's duration; autocast
stays excluded, as it is for any custom-op implementation. Outside a mode this is one TLS read.
"""
from __future__ import annotations

import functools
import os

import torch
from torch.utils import _python_dispatch as _dispatch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from torchfuser import backends as _backends
from torchfuser.backends import kernel as _backend_kernel, reference as _reference
from torchfuser.switches import SWITCHES as _SWITCHES

_C = torch._C
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_PLAIN_TYPES = frozenset(_PLAIN)
_SCALAR_TYPES = frozenset((float, int, bool, str, type(None), torch.dtype))  # never tensors: no isinstance
_DK = _C.DispatchKey
_ABOVE_PYTHON = _C._dispatch_keyset_full() - _C._dispatch_keyset_full_after(_DK.Python)
_REENABLE = _ABOVE_PYTHON - _C.DispatchKeySet(_DK.Python)
for _name in dir(_DK):
    if _name.startswith("Autocast"):
        _REENABLE = _REENABLE - _C.DispatchKeySet(getattr(_DK, _name))


def _with_keys(fn, *args):
    excluded = _C._dispatch_tls_local_exclude_set()
    with _C._ForceDispatchKeyGuard(_C._dispatch_tls_local_include_set(), excluded - _REENABLE):
        return fn(*args)


def _without_autocast(fn, *args):
    with _C._DisableAutocast():
        return fn(*args)


def _own_storage(out):
    """Forward outputs as tensors of their own, not views: backends hand out views of the buffers
    they wrote (MLIR's row-flattened results, rope's B×S×H×D memory seen as B×H×S×D), and autograd
    forbids in-place updates of a custom Function's view outputs (XLM does ``tensor *= mask`` on a
    norm's output). ``detach`` drops the view relation at no cost; the storage and strides stay."""
    if isinstance(out, tuple):
        for o in out:  # (None: an _infer's statistic)
            if o is not None and o._is_view():
                return tuple(o.detach() if o is not None and o._is_view() else o for o in out)
        return out
    return out.detach() if out._is_view() else out


def _forward_kernel(fn, *args):
    return _own_storage(fn(*args))


_WRAPPED: dict = {}  # a backend's forward kernel -> it wrapped in _forward_kernel: made once, not per call


def kernel(backend: str, name: str):
    fn = _backend_kernel(backend, name)
    if name.endswith("_fwd"):
        wrapped = _WRAPPED.get(fn)
        if wrapped is None:
            wrapped = _WRAPPED[fn] = functools.partial(_forward_kernel, fn)
        fn = wrapped
    if _C._is_any_autocast_enabled():
        # An implementation sees its inputs' dtypes, never autocast's: compiled graphs run it that
        # way (autocast is applied when tracing, around the op), and the reference backend's fp32
        # products must not be turned back into bf16 ones in eager.
        fn = functools.partial(_without_autocast, fn)
    if not _C._dispatch_tls_is_dispatch_key_excluded(_DK.FuncTorchDynamicLayerFrontMode):
        return fn
    return lambda *args: _with_keys(fn, *args)


# MLIR on the CPU: a compiled kernel's call costs 10-40 µs of host time before any work (argument packing,
# the ExecutionEngine's call), which a decode step's few rows never pay back. Measured per op (thread CPU
# time, one thread, benchmarks/probes/generate_mlir_crossover.py; NOTES-trl.md "Rollouts with generate"):
# the reference kernel is cheaper up to ~64k elements of the first input for rms_norm, add_rms_norm, swiglu
# and rope. So a no-grad call whose first input has at most ``MLIR_SMALL`` elements runs the reference
# kernel (the report says so), unless ``switches.mlir_small_to_reference`` is off (a test that must run the
# MLIR kernels on a few rows without grad turns it off) or the call runs inside a backward pass (a recompute,
# which must give bit for bit what the forward gave). The price: a no-grad call (TRL's scoring of the old
# log-probs) and a grad-mode call of the same small input (the training forward) may differ by the two
# backends' rounding (within the accuracy rule; unfused they are equal); the switch off makes them equal.
MLIR_SMALL = 32768


def _small_mlir(args) -> bool:
    # Not inside a backward pass: what a backward makes again under no_grad (modules.recompute: an MLP's
    # activation) must be bit for bit what the grad-mode forward made, with the same kernel.
    return (args[-1] == "mlir" and args[0].numel() <= MLIR_SMALL and _SWITCHES.mlir_small_to_reference
            and _C._current_graph_task_id() == -1)


SMALL_NOTE = "mlir: "  # the start of the report's note on it (refreshed at every report)


def small_calls_note(backends) -> list[str]:
    """The report's note where a fused block runs MLIR kernels and small no-grad calls take the reference ones."""
    if "mlir" not in backends or not _SWITCHES.mlir_small_to_reference:
        return []
    return [f"{SMALL_NOTE}calls without grad mode of at most {MLIR_SMALL} elements (a decode step's rows) run the "
            "reference kernels, measured cheaper per call there (switches.mlir_small_to_reference; NOTES-trl.md)"]


_RAW: dict = {}  # (backend, forward kernel name) -> what nograd_forward calls for it (_inference_kernel)


def nograd_forward(fwd_name: str, args: tuple):
    """The forward kernel ``fwd_name`` of ``args[-1]``'s backend on ``args[:-1]``, for a plain eager call
    without grad mode (the caller checks ``plain_eager``): no autograd Function, no custom op, the kernel
    resolved once per (backend, op) rather than per call, and the backend's ``<op>_infer`` where it has one
    (``_inference_kernel``; the same values, bit for bit). MLIR calls of a few rows take the reference
    kernel (``MLIR_SMALL``). Autocast (the kernel must not see it) and functorch's excluded keys go the
    general way, through ``kernel``."""
    backend = args[-1]
    if backend == "mlir" and _small_mlir(args):
        backend = "reference"
    if _C._is_any_autocast_enabled() or _C._dispatch_tls_is_dispatch_key_excluded(_DK.FuncTorchDynamicLayerFrontMode):
        return kernel(backend, fwd_name)(*args[:-1])
    fn = _RAW.get((backend, fwd_name))
    if fn is None:
        fn = _RAW[(backend, fwd_name)] = _inference_kernel(backend, fwd_name)
    return fn(*args[:-1])


def _inference_kernel(backend: str, fwd_name: str):
    """The backend's ``<op>_infer`` where it has one (the forward's values without what only its backward
    needs: statistics, layouts; tensors of their own, never views, so called as they are), else its
    ``<op>_fwd``, wrapped as ``kernel`` wraps forwards (``_own_storage``)."""
    infer = getattr(_backends.kernels(backend), fwd_name.removesuffix("_fwd") + "_infer", None)
    return kernel(backend, fwd_name) if infer is None else infer


def autocast_enabled(device_type: str) -> bool:
    """``torch.is_autocast_enabled(device_type)``, False on devices autocast does not know (meta:
    shape propagation through a fused model must not fail where the plain model runs)."""
    return device_type in ("cpu", "cuda", "xpu", "mps", "hpu") and torch.is_autocast_enabled(device_type)


def plain_eager(args) -> bool:
    """Whether a call may skip the dispatcher: plain tensors, eager mode, no tracing, no dispatch
    or function mode, no functorch transform. Everywhere else the registered custom op (fake
    impl, autograd, aliasing rules) is what makes the call work."""
    if torch.compiler.is_compiling() or _C._is_torch_function_mode_enabled():
        return False
    if is_in_torch_dispatch_mode() or _C._functorch.peek_interpreter_stack() is not None:
        return False
    for a in args:  # a loop, not a generator: every fused call runs this (host time)
        # The argument's type looked up first: isinstance against torch.Tensor (its metaclass) costs more
        t = type(a)
        if t not in _PLAIN_TYPES and t not in _SCALAR_TYPES and isinstance(a, torch.Tensor):
            return False
    return True


def _plain_rows(args) -> bool:
    """``plain_eager(args)`` and no empty tensor among them (``for_empty`` would change nothing), in one pass:
    what a no-grad call checks before ``nograd_forward`` (a decode step makes one such call per fused op)."""
    if torch.compiler.is_compiling() or _C._is_torch_function_mode_enabled():
        return False
    if _dispatch._is_in_torch_dispatch_mode or _C._functorch.peek_interpreter_stack() is not None:
        return False
    for a in args:
        t = type(a)
        if t in _PLAIN_TYPES:
            if a.numel() == 0:
                return False
        elif t not in _SCALAR_TYPES and isinstance(a, torch.Tensor):
            return False
    return True


def run(op, *args):
    """``op(*args)``, straight to its implementation where the dispatcher has nothing to add."""
    impl = getattr(op, "_init_fn", None)
    return impl(*args) if impl is not None and plain_eager(args) else op(*args)


# Under torch.compile with the Triton backend, these ops go to Inductor as their definitions by
# default: it fuses RMSNorm with the residual add before it and the casts after it, forward and
# backward, which our kernel cannot do as an opaque op (llama1b: 129.0 against 132.6 ms a step;
# NOTES-train-step.md, run 17). SwiGLU and RoPE as Inductor's code were slower than our kernels.
AUTO_TO_INDUCTOR = ("rms_norm", "add_rms_norm")
_POLICY = "TORCHFUSER_COMPILED_ELEMENTWISE"


def inductor_fuses(backend: str, op: str) -> bool:
    """Whether an elementwise op traced by torch.compile goes to Inductor as its definition (plain
    PyTorch, which Inductor fuses with its neighbours) instead of as an opaque custom op. Only for
    the Triton backend; ``$TORCHFUSER_COMPILED_ELEMENTWISE`` picks which: ``auto`` (default:
    ``AUTO_TO_INDUCTOR``), ``kernels`` (none), ``inductor`` (all) or ``inductor:rms_norm,swiglu_packed``."""
    if backend != "triton" or not torch.compiler.is_compiling():
        return False
    policy = os.environ.get(_POLICY, "auto")
    if policy == "auto":
        return op in AUTO_TO_INDUCTOR
    kind, _, names = policy.partition(":")
    if kind not in ("kernels", "inductor") or (kind == "kernels" and names):
        raise ValueError(f"{_POLICY}={policy!r}: use auto, kernels, inductor or inductor:<op>,<op> "
                         "(op names as in torchfuser.functional, e.g. rms_norm, swiglu_packed, rope)")
    return kind == "inductor" and (not names or op in names.split(","))


def empty(*tensors) -> bool:
    for t in tensors:  # a loop, not a generator: every fused call runs this (host time)
        if isinstance(t, torch.Tensor) and t.numel() == 0:
            return True
    return False


def for_empty(args: tuple) -> tuple:
    """``args`` (backend last) with the reference backend for an empty tensor (no rows, or rows of
    width 0): plain PyTorch gives what PyTorch gives on those, while a compiled kernel has nothing to
    compile for (MLIR rejects zero-size memrefs; Triton cannot view no elements as rows)."""
    return (*args[:-1], "reference") if args[-1] != "reference" and empty(*args) else args


def autograd(fwd_op, setup, backward, elementwise: bool = True):
    """Register ``backward`` as ``fwd_op``'s autograd and return the op's entry point.

    In plain eager mode the entry point runs the same kernels, ``setup`` and ``backward``
    through a ``torch.autograd.Function``: the custom-op dispatcher costs about 50 µs a call on
    each of the forward and the backward, which for a norm of a few thousand rows is more than
    the kernel. Under torch.compile, tracing, dispatch modes or tensor subclasses it calls the
    registered custom op, or, for an ``elementwise`` op that ``inductor_fuses``, the reference
    backend's definition of the op (the same name), which torch.compile differentiates itself.
    """
    fwd_op.register_autograd(backward, setup_context=setup)
    impl = getattr(fwd_op, "_init_fn", None)

    class Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            ctx.set_materialize_grads(False)
            out = impl(*args)
            setup(ctx, args, out)
            return out

        @staticmethod
        def backward(ctx, *grads):
            return backward(ctx, *grads)

    fwd_name = fwd_op._name.split("::")[-1]  # "rms_norm_fwd"
    definition = getattr(_reference, fwd_name) if elementwise else None
    op = fwd_name.removesuffix("_fwd")
    nograd = impl is not None and elementwise

    def call(*args):
        if nograd and not torch.is_grad_enabled() and _plain_rows(args):
            # No graph to record (generate, TRL's rollouts and reference scoring): the kernel alone, checked in
            # one pass (the general way below makes the same call after for_empty and plain_eager).
            return nograd_forward(fwd_name, args)
        args = for_empty(args)
        if impl is not None and plain_eager(args):
            # No graph to record (generate, TRL's rollouts and reference scoring run under no_grad):
            # the kernel alone, without the autograd Function's bookkeeping and saved tensors.
            if torch.is_grad_enabled():
                return Eager.apply(*args)
            # An elementwise op's implementation is its backend's forward kernel on args[:-1]: called as that.
            return nograd_forward(fwd_name, args) if elementwise else impl(*args)
        if definition is not None and inductor_fuses(args[-1], op):
            # As the kernels do: the inputs' dtypes, never autocast's.
            with torch.autocast(args[0].device.type, enabled=False):
                return definition(*args[:-1])
        return fwd_op(*args)

    return call
