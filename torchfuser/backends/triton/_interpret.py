"""Fixes for Triton's CPU interpreter (TRITON_INTERPRET=1), applied only in interpreter mode.

1. NumPy ≥ 2.4: Triton 3.6's interpreter turns a scalar kernel value into a Python int with
   ``int(handle.data)``, where ``data`` is a 1-element array; NumPy 2.4 made that a TypeError, so
   every ``range(...)`` over a runtime bound inside a kernel fails (triton-lang/triton#9171, fixed
   upstream by converting through ``squeeze()``). Patched only when the installed NumPy rejects
   the conversion, and only that one attribute.
2. fp32 → bf16 casts: the interpreter truncates (drops the low 16 bits), where compiled Triton
   rounds to nearest even (LLVM's fptrunc, ``cvt.rn.bf16.f32``), as PyTorch does. Every bf16
   store of an interpreted kernel was then up to one ulp off the GPU's, and a kernel's x + r in
   bf16 could not be compared bit for bit with torch's. Patched only when the interpreter's cast
   truncates, and only for that one pair of dtypes.
3. fp32 → e4m3 (``tl.float8e4nv``) casts: the interpreter rounds half up and lets a rounded-up
   mantissa spill into the exponent by OR, not by carry (127.7 became 64, not 128), where the GPU's
   ``cvt.rn.satfinite.e4m3x2.f32`` rounds to nearest even and saturates to ±448, as PyTorch's
   ``.to(torch.float8_e4m3fn)`` rounds (PyTorch gives NaN past 464 where the GPU saturates: the FP8
   kernels clamp to ±448 first, so they never differ there). Patched only for that pair of dtypes,
   only when the interpreter's cast gets 127.7 wrong.
4. ``tl.dot`` of bf16 operands: the interpreter holds bf16 as its uint16 bit patterns and multiplied
   those integers (1.0 · 1.0 gave 16256², the GEMM of the 4-bit dequantising kernel came out ~1e11).
   The operands are widened to fp32 first (exact), as the GPU's bf16 MMA takes them with fp32
   accumulation. Patched only when the interpreter's bf16 dot gets 1 · 1 wrong.
"""
from __future__ import annotations


def apply() -> None:
    from triton import knobs

    if not knobs.runtime.interpret:
        return
    _fix_scalar_index()
    _fix_bf16_rounding()
    _fix_e4m3_rounding()
    _fix_bf16_dot()


def _fix_scalar_index() -> None:
    import numpy as np

    try:
        int(np.array([1]))
        return  # this NumPy still converts 1-element arrays: nothing to fix
    except TypeError:
        pass
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_torchfuser_fixed", False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor._torchfuser_fixed = True
    interpreter._patch_lang_tensor = patch_lang_tensor


def _fp32_to_bf16_bits(data):
    """bf16 bit patterns (uint16) of fp32 ``data``, rounded to nearest even; NaN stays NaN."""
    import numpy as np

    bits = np.ascontiguousarray(data, dtype=np.float32).view(np.uint32)
    with np.errstate(over="ignore"):  # only NaN patterns wrap, and they are replaced below
        rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    quiet_nan = ((bits >> 16) | np.uint32(0x0040)).astype(np.uint16)
    return np.where(np.isnan(data), quiet_nan, rounded).reshape(np.shape(data))


def _fix_bf16_rounding() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.cast_impl
    if getattr(original, "_torchfuser_fixed", False):
        return
    probe = interpreter.TensorHandle(np.array([1.0 + 2.0**-8 + 2.0**-9], dtype=np.float32), tl.float32)
    if original(None, probe, tl.bfloat16).data.view(np.uint16)[0] != 0x3F80:
        return  # this interpreter does not truncate (1 + 3/512 rounds up to 1 + 1/128): nothing to fix

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(_fp32_to_bf16_bits(src.data), dst_type.scalar)
        return original(self, src, dst_type)

    cast_impl._torchfuser_fixed = True
    builder.cast_impl = cast_impl


def fp32_to_e4m3_bits(data):
    """e4m3fn bit patterns (uint8) of fp32 ``data`` as ``cvt.rn.satfinite.e4m3x2.f32`` gives them:
    round to nearest even (subnormals included), ±448 past the largest finite value, NaN as 0x7F
    (with the sign bit)."""
    import numpy as np

    x = np.ascontiguousarray(data, dtype=np.float32)
    bits = x.view(np.uint32)
    sign = ((bits >> 24) & np.uint32(0x80)).astype(np.uint8)
    a = np.abs(x).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        # Below 2^-6 (e4m3's smallest normal) the code is |x| / 2^-9 rounded to an integer (0..8; 8 is
        # 2^-6's code); above it, exponent and 3 mantissa bits, the rounding's carry going into the
        # exponent as an integer add does.
        sub = np.rint(a * 512.0)
        m = bits & np.uint32(0x7FFFFF)
        e = ((bits >> 23) & np.uint32(0xFF)).astype(np.int64) - 127
        r = (m >> 20).astype(np.int64)
        rem = m & np.uint32(0xFFFFF)
        up = (rem > 0x80000) | ((rem == 0x80000) & (r & 1 == 1))
        normal = ((e + 7) << 3) + r + up
        code = np.where(a < 2.0**-6, sub, normal)
        code = np.minimum(code, 0x7E)  # 448: satfinite
    code = np.where(np.isnan(x), 0x7F, code).astype(np.uint8)
    return (code | sign).reshape(np.shape(data))


def _fix_e4m3_rounding() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_fp_to_fp
    if getattr(original, "_torchfuser_fixed", False):
        return
    probe = interpreter.TensorHandle(np.array([127.7], dtype=np.float32), tl.float32)
    if original(None, probe, tl.float8e4nv, None).data.view(np.uint8)[0] == fp32_to_e4m3_bits(np.float32(127.7)):
        return  # this interpreter rounds 127.7 to 128 already: nothing to fix

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
            return interpreter.TensorHandle(fp32_to_e4m3_bits(src.data), dst_type.scalar)
        return original(self, src, dst_type, rounding_mode)

    create_fp_to_fp._torchfuser_fixed = True
    builder.create_fp_to_fp = create_fp_to_fp


def _fix_bf16_dot() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot
    if getattr(original, "_torchfuser_fixed", False):
        return

    def widen(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        return interpreter.TensorHandle((h.data.astype(np.uint32) << np.uint32(16)).view(np.float32), tl.float32)

    one = interpreter.TensorHandle(np.array([[0x3F80]], dtype=np.uint16), tl.bfloat16)
    acc = interpreter.TensorHandle(np.zeros((1, 1), dtype=np.float32), tl.float32)
    if original(None, one, one, acc, None, None).data[0, 0] == 1.0:
        return  # this interpreter multiplies bf16 values, not their bits: nothing to fix

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    create_dot._torchfuser_fixed = True
    builder.create_dot = create_dot
