"""FP8 GEMMs for the fused blocks' projections: ``optimize(model, fp8="rowwise" | "tensorwise" | "blockwise")``.

Each projection y = x·Wᵀ (+ b) of a fused block (the joint q/k/v, the output projection, the joint
gate/up, the down projection; with LoRA adapters, the bases' products in the fused LoRA node,
``modules.adapters.lora``; the LM head only with ``fp8_lm_head=True``, in backends/*/linear_cross_entropy.py) runs
three FP8 GEMMs through
``torch._scaled_mm``, every operand in e4m3 with current (dynamic) scaling, no state that could go stale:

    forward   y  = q(x)·q(W)ᵀ          scales along K: per token of x, per output channel of W
    backward  dx = q(dy)·q(Wᵀ)ᵀ        along N: per token of dy, per input channel of W
              dW = q(dyᵀ)·q(xᵀ)ᵀ       along M: per output channel of dy, per input channel of x

(``tensorwise``: one scale per tensor instead; ``blockwise``: one per 128 elements along the same
dimensions, and per 128 × 128 block of W, backends/reference/fp8_blocks.py, its products
``_fp8_gemm.mm_blocks``; experimental). Scales are amax / 448 (e4m3's largest finite value),
in fp32, and the values are multiplied by 448 / amax before the cast (backends/reference/fp8_quant.py).
A weight's two quantised copies are made at every call by default (``fp8_weights="per_call"``), trainable
or frozen (LoRA's bases): nothing read on the host can tell a stale copy. Fused optimizers
(``AdamW(fused=True)``) update parameters in place without bumping their version counter (one such cache
trained llama1b on step 0's weights), and a write through ``param.data`` (``.data.copy_``, EMA, weight
averaging, loading base weights, PEFT's ``merge_adapter``) goes to a version counter of its own, leaving the
parameter's version and storage as they were (a version-keyed copy of a frozen base stayed 0.217 off). The
cost is a pass over each weight per call (read 2 + 2, write 1 + 1 bytes a bf16 weight; for a frozen 8 B base
≈ 48 GB a forward), which CUDA-graph and torch.compile captures paid anyway; no copy is
held between calls (a cached frozen base held 2 bytes a weight: ≈ 13 GiB on an 8 B model).
With ``fp8_weights="per_step"`` every weight's copies are kept until any ``torch.optim`` optimizer steps (or
its version or storage changes: ``load_state_dict``, in-place ops, ``param.data = t``, ``swap_tensors``): once
per optimizer step, not per micro-batch or checkpointed recompute, at 2 bytes a weight kept between calls
(``fp8.step``). A ``param.data`` write is seen from the first call after the next optimizer step, not before
(so per step assumes none between a step and the calls that follow it). Inside torch.compile and CUDA-graph
captures every weight is quantised in the graph, every call (a recorded copy would go stale).

On CUDA the quantisation is Triton kernels (``ops.fp8_quant``, backends/triton/fp8_quant.py; bit for
bit the PyTorch formula the CPU runs). An operand two GEMMs take, once scaled along each of its
dimensions, is quantised both ways in one call (``quantize_both``; no transposed bf16 copy; on the CPU
the two reference quantisations): tensorwise one amax pass for both, then one pass writing both e4m3
copies (t read twice); rowwise likewise, the row and column maxima taken in one pass with atomics
(backends/triton/fp8_quant.py, the faster in whole steps on an H200). Per trainable projection and
step, rowwise, in bytes an element (bf16 activations):

    x   forward: both ways (read 2 + 2, write 1 + 1; the down projection's, from SwiGLU's maxima: read 2,
        write 1 + 1); e4m3 xᵀ kept for dW (1 B, not x's 2 B in bf16), so the backward reads no x
    dy  both ways (read 2 + 2, write 1 + 1; gate/up's, from SwiGLU's backward: read 2, write 1 + 1)
    W   fp32 master weights, both ways at every call (read 4 + 4, write 1 + 1)

Where only one of the two is needed, only that one runs (rowwise: one read; else two): frozen
weights (no dW: x and dy rowwise, nothing of x kept), an input that needs no gradient (dy transposed
only), no grad mode (x rowwise, no autograd Function at all); tensorwise likewise, with no host sync.
The bias is added in the GEMM's epilogue, and dW is asked of its GEMM in the weights' dtype (no cast
where the GEMM writes it). Under torch.compile the quantisation is traced as PyTorch code, for
Inductor to fuse with the kernel producing the operand (``TORCHFUSER_COMPILED_ELEMENTWISE=kernels``:
the Triton kernels).
Producers of ours take the maxima as they write an operand (``producer_maxima``): SwiGLU / GeGLU forward
(the down projection's x) and backward (the gate/up projection's dy), so that operand's both-ways call is
the writer alone (ops.fp8_quant.attach_amax, backends/triton/gated_fp8.py). A fused decoder layer's norms
can be producers too (the q/k/v and gate/up projections' x, the output projection's dy; norm_fp8.py),
but are not by default: measured slower than the pass they replace (the switch ``fp8_norm_producers``,
``torchfuser.switches``). The
operand is still written in bf16 and read once more: the transposed copy needs every token's column
maximum before its first value is cast. It runs where ``torch._scaled_mm`` does: CUDA GPUs of compute
capability 8.9 or newer, and the CPU (slow, for tests).
"""
from __future__ import annotations


import torch
from torch import Tensor, nn

from torchfuser.backends._fp8_gemm import _CPU_ROWWISE, _cpu_rowwise, mm  # noqa: F401 (tests patch them here)
from torchfuser.modules import fallbacks
from torchfuser.modules.fp8 import selfcheck as _selfcheck, step as _step
from torchfuser.modules.base import hooked
from torchfuser.ops import fp8_quant as _quant
from torchfuser.ops._call import plain_eager
from torchfuser.switches import SWITCHES as _SWITCHES

RECIPES = ("rowwise", "tensorwise", "blockwise")
BLOCK = 128  # blockwise: the elements a scale covers along a GEMM's inner dimension (128 × 128 for weights)
E4M3 = torch.float8_e4m3fn


def check(recipe, device: torch.device | None) -> str | None:
    """``recipe`` validated for ``device`` (None: no FP8); a clear error where it cannot run."""
    if recipe is None:
        return None
    if recipe not in RECIPES:
        raise ValueError(f"fp8 must be None, 'rowwise', 'tensorwise' or 'blockwise', got {recipe!r}")
    if device is not None and device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ValueError(f"fp8={recipe!r} needs a GPU of compute capability 8.9 or newer (Ada, Hopper); "
                             f"{torch.cuda.get_device_name(device)} is {major}.{minor}. Leave fp8=None on this GPU.")
        if recipe == "blockwise" and (major != 9 or not hasattr(torch.nn.functional, "scaled_mm")):
            # ATen's blockwise FP8 GEMMs are cuBLASLt's (≥ 12.9), on Hopper only
            raise ValueError(f"fp8='blockwise' needs a Hopper GPU (compute capability 9.x) and torch.nn.functional."
                             f"scaled_mm (PyTorch ≥ 2.10 built with cuBLASLt ≥ 12.9); {torch.cuda.get_device_name(device)} "
                             f"is {major}.{minor} with PyTorch {torch.__version__}. Use fp8='rowwise' here.")
        _selfcheck.ensure(recipe, device)  # this GPU's quantisers bit-exact, before anything changes
    elif device is not None and device.type != "cpu":
        raise ValueError(f"fp8={recipe!r} runs on CUDA GPUs (and the CPU, for tests), not on {device.type}")
    elif device is not None:
        _cpu_rowwise()  # probed now, before any torch.compile could trace the probe
    return recipe


WEIGHT_MODES = ("per_call", "per_step")


def check_weights(mode, recipe: str | None) -> bool:
    """Whether trainable weights' copies are kept per optimizer step (``fp8_weights``), validated."""
    if mode not in WEIGHT_MODES:
        raise ValueError(f"fp8_weights must be 'per_call' or 'per_step', got {mode!r}")
    if mode == "per_step" and recipe is None:
        raise ValueError("fp8_weights='per_step' keeps FP8 weight copies: it needs fp8='rowwise', 'tensorwise' or "
                         "'blockwise' too")
    return mode == "per_step"


def quantize(t: Tensor, recipe: str, transpose: bool = False) -> tuple:
    """(e4m3 values, fp32 scale) of a 2-D ``t``, or with ``transpose`` of ``tᵀ`` (written transposed, no
    copy of ``t``): one scale per row (rowwise, shape rows × 1) or one in all; blockwise (values, scales,
    "1x128"), a scale per row and 128 columns. One pass on CUDA."""
    if recipe == "blockwise":
        q, s, qt, st = _quant.quantize_blocks(t, not transpose, transpose)
        return (qt, st, "1x128") if transpose else (q, s, "1x128")
    return _quant.quantize(t, recipe == "tensorwise", transpose)


def quantize_both(t: Tensor, recipe: str, amax: Tensor | None = None) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """(``quantize(t, recipe)``, ``quantize(t, recipe, transpose=True)``), bit for bit: an operand two GEMMs
    take, one scaled along t's rows, one along its columns and transposed. On CUDA the Triton kernels'
    fastest measured way (the module doc); elsewhere those two quantisations (the reference composition).
    ``amax``: t's maxima, handed on by the kernel that produced t (``producer_maxima``; rowwise)."""
    if recipe == "blockwise":  # every scale local to its tile: both copies from one read, everywhere
        q, s, qt, st = _quant.quantize_blocks(t, True, True)
        return (q, s, "1x128"), (qt, st, "1x128")
    if t.is_cuda or (amax is not None and recipe == "rowwise"):
        return _quant.quantize_both(t, recipe == "tensorwise", amax)
    return quantize(t, recipe), quantize(t, recipe, transpose=True)


# Producers of ours hand their outputs' maxima on (torchfuser.switches: fp8_producers, on; the decoder
# layers' norms among them, fp8_norm_producers, off: measured slower, docs/performance/NOTES-fp8.md).


def producer_maxima(owner: nn.Module, t: Tensor, consumers: list[nn.Module], dtype: torch.dtype | None = None) -> bool:
    """Whether the kernel of ours producing ``t`` (or, per the caller, t's gradient, or an output of t's
    shape in ``dtype``) should take its maxima and hand them on to the FP8 GEMMs of ``consumers``, which
    take it both ways: rowwise FP8 on ``owner``, plain eager autograd (nothing is attached under
    torch.compile), bf16 and not empty, a trainable plain nn.Linear."""
    return (_SWITCHES.fp8_producers and recipe_of(owner) == "rowwise" and torch.is_grad_enabled()
            and (dtype or t.dtype) == torch.bfloat16 and t.numel() > 0
            and all(type(m) is nn.Linear for m in consumers) and any(m.weight.requires_grad for m in consumers)
            and plain_eager((t,)))


class _Weights:
    """A weight's (or concatenated weights') two quantised copies: remade at every call, or with
    ``per_step`` kept until an optimizer steps, frozen weights as trainable ones (module docstring)."""

    __slots__ = ("key", "fwd", "bwd", "per_step")

    def __init__(self, per_step: bool = False):
        self.key = self.fwd = self.bwd = None
        self.per_step = per_step

    def get(self, weights, recipe: str):
        counted = _step.steps() if self.per_step else None
        if counted is None or _recording(weights[0]):
            # Per call, frozen weights included: a write through ``param.data`` (EMA, weight averaging,
            # loading base weights, PEFT's merge) moves neither the version nor the storage, and a fused
            # optimizer's step leaves the version as it was, so no key read on the host could tell a stale
            # copy. A compiled graph or a CUDA graph replays what it recorded: per call there too. (per_step
            # with no step hook in, nothing counts the steps: per call too.)
            return _both(weights, recipe)
        # per_step: the optimizer steps counted (fp8.step) key every copy, beside the versions and storages
        key = (recipe, counted, *((id(w), w._version, w.data_ptr()) for w in weights))
        if key != self.key:
            self.fwd = self.bwd = None  # the old copies freed before the new are made
            self.fwd, self.bwd = _both(weights, recipe)
            self.key = key
        return self.fwd, self.bwd


def _recording(t: Tensor) -> bool:
    """Whether this call is being recorded into a graph (torch.compile's trace, a CUDA-graph capture)."""
    return torch.compiler.is_compiling() or (t.is_cuda and torch.cuda.is_current_stream_capturing())


def _both(weights, recipe: str):
    """(the weights' N × K copy scaled per output channel, their K × N copy per input channel): the
    rowwise quantisations of W and of Wᵀ, from one ``quantize_both``."""
    w = weights[0] if len(weights) == 1 else torch.cat(weights)
    if torch.is_grad_enabled():  # (the autograd Functions call this with grad mode off already)
        with torch.no_grad():
            return _weight_copies(w, recipe)
    return _weight_copies(w, recipe)


def _weight_copies(w: Tensor, recipe: str):
    if recipe == "blockwise":  # one scale per 128 × 128 block, shared by W and Wᵀ
        q, s_fwd, qt, s_bwd = _quant.quantize_weight_blocks(w)
        return (q, s_fwd, "128x128"), (qt, s_bwd, "128x128")
    return quantize_both(w, recipe)


def weights_cache(owner: nn.Module, linears: list[nn.Module]) -> _Weights:
    """The quantised-weight cache of one projection group of a fused module (per step where
    ``owner._fp8_per_step`` is set: ``optimize(..., fp8_weights="per_step")``)."""
    store = owner.__dict__.get("_fp8_weights")
    if store is None:
        store = owner.__dict__["_fp8_weights"] = {}
    key = tuple(map(id, linears))
    cache = store.get(key)
    if cache is None:
        cache = store[key] = _Weights(owner.__dict__.get("_fp8_per_step", False))
    return cache


def _project(x: Tensor, recipe: str, cache: _Weights, out_dtype: torch.dtype, n: int, params, dw: bool):
    """(y, dW's operand xᵀ quantised or None, the weights' dx copy): the forward of ``_FP8Linear``.
    With ``dw`` x is quantised both ways at once (t read twice in all, ``quantize_both``) and the e4m3
    xᵀ is what the backward keeps, not x; without, rowwise only."""
    fwd, bwd = cache.get(params[:n], recipe)
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    nb = len(params) - n
    b = None if not nb else params[n] if nb == 1 else torch.cat(params[n:])
    if dw:
        qx, qxt = quantize_both(x2, recipe, _quant.attached_amax(x))
    else:
        qx, qxt = quantize(x2, recipe), None
    y = mm(qx, fwd, out_dtype, bias=b)
    return (y if x2 is x else y.view(*x.shape[:-1], y.shape[-1])), qxt, bwd


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, recipe, cache, out_dtype, n, *params):
        need = ctx.needs_input_grad
        dw = True in need[5:5 + n]
        y, qxt, bwd = _project(x, recipe, cache, out_dtype, n, params, dw)
        if dw:
            ctx.save_for_backward(*qxt[:2])  # e4m3 xᵀ and its fp32 scales: half of x's bf16 bytes
            ctx.blocks = qxt[2:]  # blockwise: the scales' kind
            w_dtypes = {w.dtype for w in params[:n]}
            # dW in the weights' dtype straight from the GEMM where they share one
            ctx.dw_dtype = w_dtypes.pop() if len(w_dtypes) == 1 else torch.float32
        ctx.recipe, ctx.n, ctx.dw, ctx.shape, ctx.x_dtype = recipe, n, dw, x.shape, x.dtype
        ctx.bwd = bwd if need[0] else None
        ctx.rows = [w.shape[0] for w in params[:n]] if n > 1 else None
        ctx.dtypes = [p.dtype for p in params]
        return y

    @staticmethod
    def backward(ctx, dy):
        # Autocast off here as in the forward: a backward called inside the user's autocast region must
        # compute what one called outside it does (autocast would recast the CPU's emulated products).
        with _no_autocast(dy):
            return _FP8Linear._backward(ctx, dy)

    @staticmethod
    def _backward(ctx, dy):
        recipe, n, dw = ctx.recipe, ctx.n, ctx.dw
        dy2 = dy if dy.dim() == 2 else dy.reshape(-1, dy.shape[-1])
        need = ctx.needs_input_grad
        need_x = need[0]
        # dy scaled per token for dx, and per output channel, transposed, for dW = dyᵀ·x: both from one
        # quantize_both where both are needed.
        if need_x and dw:
            qdy, qdyt = quantize_both(dy2, recipe, _quant.attached_amax(dy))
        elif need_x:
            qdy = quantize(dy2, recipe)
        elif dw:
            qdyt = quantize(dy2, recipe, transpose=True)
        dx = None
        if need_x:
            dx = mm(qdy, ctx.bwd, ctx.x_dtype)
            if dx.shape != ctx.shape:
                dx = dx.view(ctx.shape)
        grads = [None] * (len(need) - 5)
        dtypes = ctx.dtypes
        if dw:
            g = mm(qdyt, (*ctx.saved_tensors, *ctx.blocks), ctx.dw_dtype)
            parts = (g,) if n == 1 else g.split(ctx.rows)
            for i in range(n):
                if need[5 + i]:
                    grads[i] = parts[i] if parts[i].dtype == dtypes[i] else parts[i].to(dtypes[i])
        if True in need[5 + n:]:
            db = dy2.sum(0, dtype=torch.float32)
            parts = (db,) if n == 1 else db.split(ctx.rows)
            for i in range(n):
                if need[5 + n + i]:
                    grads[n + i] = parts[i] if parts[i].dtype == dtypes[n + i] else parts[i].to(dtypes[n + i])
        return (dx, None, None, None, None, *grads)


def recipe_of(owner: nn.Module | None) -> str | None:
    return None if owner is None else owner.__dict__.get("_fp8")


def usable(x: Tensor, linears: list[nn.Module], owner: nn.Module | None) -> str | None:
    """The recipe where this call of ``linears`` (bases of a LoRA layer included) can run FP8 GEMMs,
    else None; a call FP8 is on for but cannot take is counted, with the reason, on ``owner``."""
    recipe = recipe_of(owner)
    if recipe is None:
        return None
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    if dtype != torch.bfloat16:
        fallbacks.count(owner, f"fp8: projections ran in {str(dtype).removeprefix('torch.')}, not FP8 (FP8 GEMMs need bf16 "
                               "autocast or bf16 weights)")
        return None
    k = x.shape[-1]
    rows, n = x.numel() // max(k, 1), sum(m.out_features for m in linears)
    if rows == 0:  # nothing to scale (a scale of no tokens is undefined): the bf16 path gives the empty result
        fallbacks.count(owner, "fp8: a call with no tokens ran in bf16")
        return None
    if rows % 16 or k % 16 or n % 16:  # FP8 GEMM kernels take multiples of 16 (tokens: dW's inner dimension)
        fallbacks.count(owner, f"fp8: projections ran in bf16, not FP8: {rows} tokens × {k} → {n} is not in "
                               "multiples of 16 (pad the batch's tokens to a multiple of 16)")
        return None
    if recipe == "blockwise" and (rows % BLOCK or k % BLOCK or n % BLOCK):  # whole blocks along every inner dimension
        fallbacks.count(owner, f"fp8: projections ran in bf16, not FP8: {rows} tokens × {k} → {n} is not in multiples "
                               f"of {BLOCK}, blockwise's blocks (pad the batch's tokens to a multiple of {BLOCK}, or use fp8='rowwise')")
        return None
    if not _selfcheck.checked(recipe, x.device) and not _recording(x):  # a model moved to a GPU after optimize
        _selfcheck.ensure(recipe, x.device)
    return recipe


def linear(x: Tensor, linears: list[nn.Module], owner: nn.Module) -> Tensor | None:
    """``torch.cat([m(x) for m in linears], -1)`` with FP8 GEMMs (``owner._fp8`` set by optimize), or
    None where the projections are not plain nn.Linear or the call cannot take FP8 (then as usual)."""
    params, biases = [], []
    for m in linears:
        if type(m) is not nn.Linear:
            return None
        params.append(m.weight)
        if m.bias is not None:
            biases.append(m.bias)
    if (biases and len(biases) != len(linears)) or hooked(*linears):
        return None
    recipe = usable(x, linears, owner)
    if recipe is None:
        return None
    cache, n = weights_cache(owner, linears), len(params)
    params += biases
    if not torch.is_grad_enabled():  # no backward: no autograd Function, x rowwise only, nothing kept
        with _no_autocast(x):
            return _project(x, recipe, cache, torch.bfloat16, n, params, False)[0]
    with _no_autocast(x):
        return _FP8Linear.apply(x, recipe, cache, torch.bfloat16, n, *params)


def _no_autocast(x: Tensor):
    """Autocast off for the call (every cast in it is explicit; the CPU's emulated products must stay
    fp32): the C++ guard in eager (≈ 0.4 µs of host time, against ≈ 2.4 for ``torch.autocast``), and
    ``torch.autocast``, the context manager Dynamo traces, under torch.compile."""
    if torch.compiler.is_compiling():
        return torch.autocast(x.device.type, enabled=False)
    return torch._C._DisableAutocast()
