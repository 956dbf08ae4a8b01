"""Numerical probes: run a candidate block on small random float64 inputs and compare it with
the formula a pattern would fuse it into. This is how patterns check the math, not the name.

Probes never touch the model's own tensors (the model may live on the meta device or a GPU):
they run a shallow copy of the module whose parameters and projection submodules are replaced
by fresh random CPU float64 ones.
"""
from __future__ import annotations

import contextlib
import copy
import ctypes
import functools
import os

import torch
from torch import nn

try:  # GPT-2 style projections: weight stored (in, out)
    from transformers.pytorch_utils import Conv1D
except ImportError:  # pragma: no cover - transformers is a dependency
    Conv1D = None

PROBE_ROWS = 4
# fp32 arithmetic inside the probed forward bounds the agreement we can ask for.
RTOL = 1e-5


def generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    a, b = a.double(), b.double()
    return bool(((a - b).abs().max() <= RTOL * (b.abs().max() + 1e-12)).item())


def shallow_copy(module: nn.Module) -> nn.Module:
    """A copy sharing code and plain attributes, with its own parameter/buffer/module dicts."""
    probe = copy.copy(module)
    probe._parameters = dict(module._parameters)
    probe._buffers = dict(module._buffers)
    probe._modules = dict(module._modules)
    probe.training = False  # not .eval(): that would recurse into children shared with the model
    return probe


def random_params(module: nn.Module, gen: torch.Generator) -> nn.Module:
    """``shallow_copy`` with every direct parameter replaced by a random CPU float64 one."""
    probe = shallow_copy(module)
    for name, p in module._parameters.items():
        if p is not None:
            probe._parameters[name] = nn.Parameter(randn(*p.shape, gen=gen), requires_grad=False)
    return probe


def projection_dims(module: nn.Module) -> tuple[int, int] | None:
    """(in_features, out_features) of a Linear or Conv1D projection, else None."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if Conv1D is not None and isinstance(module, Conv1D):
        return module.weight.shape[0], module.weight.shape[1]
    return None


def small_projection(module: nn.Module, n_in: int, n_out: int, gen: torch.Generator) -> nn.Module:
    """A random float64 CPU projection of the same kind (and bias-ness) with smaller dims."""
    has_bias = getattr(module, "bias", None) is not None
    if not isinstance(module, nn.Linear) and not has_bias:
        raise ValueError("Conv1D without bias")
    # Built on the meta device: the default init would draw from the global generator.
    with torch.device("meta"):
        small = nn.Linear(n_in, n_out, bias=has_bias) if isinstance(module, nn.Linear) else Conv1D(n_out, n_in)
    shape = (n_out, n_in) if isinstance(module, nn.Linear) else (n_in, n_out)
    small.weight = nn.Parameter(randn(*shape, gen=gen) / n_in**0.5, requires_grad=False)
    if has_bias:
        small.bias = nn.Parameter(randn(n_out, gen=gen), requires_grad=False)
    return small


def float_dropouts(module: nn.Module) -> list[str]:
    """Float attributes that look like dropout probabilities (read by functional dropouts in the
    forward: ``attention_dropout``, ``resid_pdrop``, ...), ``attention_dropout`` first."""
    names = [n for n, v in vars(module).items() if "drop" in n and isinstance(v, (int, float)) and not isinstance(v, bool)]
    return sorted(names, key=lambda n: n != "attention_dropout")


def run(probe: nn.Module, *args):
    with torch.no_grad():
        out = probe(*args)
    return out[0] if isinstance(out, tuple) else out


def activation_kind(act) -> str | None:
    """Which standard activation a callable computes: 'silu', 'gelu_tanh', 'gelu', 'relu', 'relu2' (squared), or None."""
    if isinstance(act, nn.Dropout) or isinstance(act, nn.Module) and any(True for _ in act.parameters()):
        return None
    x = randn(64, gen=generator(1)) * 3
    try:
        with torch.no_grad(), saved_rng():  # any child is tried: one may draw (a dropout of its own kind)
            y = act(x)
    except Exception:
        return None
    if not isinstance(y, torch.Tensor):
        return None
    candidates = {
        "silu": torch.nn.functional.silu(x),
        "gelu_tanh": torch.nn.functional.gelu(x, approximate="tanh"),
        "gelu": torch.nn.functional.gelu(x),
        "relu": torch.relu(x),
        "relu2": torch.relu(x) ** 2,
    }
    return next((k for k, ref in candidates.items() if close(y, ref)), None)


def _device_rngs():
    """(get_state, set_state) of every device generator that exists now: CUDA's only once CUDA is
    initialized (reading them would initialize it; before that nothing can have drawn from them)."""
    rngs = [(torch.get_rng_state, torch.set_rng_state)]
    if torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):
            rngs.append((lambda i=i: torch.cuda.get_rng_state(i), lambda s, i=i: torch.cuda.set_rng_state(s, i)))
    if torch.backends.mps.is_available():
        rngs.append((torch.mps.get_rng_state, torch.mps.set_rng_state))
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available() and xpu.is_initialized():
        for i in range(xpu.device_count()):
            rngs.append((lambda i=i: xpu.get_rng_state(i), lambda s, i=i: xpu.set_rng_state(s, i)))
    return rngs


@contextlib.contextmanager
def saved_rng():
    """Every device's random generator exactly as before on exit: ``optimize`` must not move the
    user's random streams (``fork_rng(devices=[])`` keeps the CPU one only)."""
    saved = [(put, get()) for get, put in _device_rngs()]
    try:
        yield
    finally:
        for put, state in saved:
            put(state)


def seed_cpu(seed: int) -> None:
    """Seed the CPU generator alone (probes run on CPU tensors); ``torch.manual_seed`` would also
    seed every CUDA device, or queue that seed for when CUDA starts. Call inside ``saved_rng``."""
    torch.default_generator.manual_seed(seed)


@functools.cache
def _omp_set_num_threads():
    """``omp_set_num_threads`` of the OpenMP runtime torch's CPU library runs its ops on, or None (no such
    library or symbol: another platform or threading backend)."""
    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        setter = ctypes.CDLL(lib).omp_set_num_threads  # looked up through libtorch_cpu's own dependencies
    except (OSError, AttributeError):
        return None
    setter.argtypes, setter.restype = [ctypes.c_int], None
    return setter


@contextlib.contextmanager
def one_thread():
    """Ops of the calling thread run on one thread while it probes: probe matmuls are tiny, and on a busy
    machine waking a thread pool makes each one ~100× slower (a 16-layer Llama matched in 0.15 s, not 2-4 s).

    Only this thread's OpenMP setting changes (OpenMP keeps the count per thread), and it is put back:
    ``torch.set_num_threads`` would change the process's (every thread that starts later, the thread
    pools), and two threads optimizing at once could leave the process at one thread. Where the runtime
    cannot be reached this way, the probes run on the threads there are."""
    n = torch.get_num_threads()  # first: torch's per-thread initialisation would reset the count later
    setter = _omp_set_num_threads() if n > 1 else None
    if setter is not None:
        setter(1)
        if torch.get_num_threads() != 1:  # not the runtime torch runs on: leave it as it was
            setter(n)
            setter = None
    try:
        yield
    finally:
        if setter is not None:
            setter(n)
