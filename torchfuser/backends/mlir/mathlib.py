"""Stage ``mathlib``: exp and tanh as plain f32 arithmetic, so that loops using them vectorise.

Why: the JIT has no vector math library, so ``math.exp`` lowers to a scalar ``expf`` call per
element and sigmoid/silu/gelu loops stay scalar. Here each ``math.exp``/``math.tanh`` on f32
becomes a call to a private function below, written in arith ops; the ``inline`` stage
inlines them into the loops.

exp: Cody–Waite range reduction x = n·ln2 + r, |r| ≤ ln2/2, a degree-6 minimax polynomial
(Cephes expf, ≈1 ulp), 2ⁿ built in the exponent bits. Over/underflow and NaN as IEEE.
tanh: sign(x)·(1 − e)/(1 + e) with e = exp(−2|x|); x − x³/3 below |x| < 2⁻⁸ (no cancellation).
"""
from __future__ import annotations

import re

LIB = r"""
func.func private @__tf_expf(%x: f32) -> f32 {
  %hi = arith.constant 88.0 : f32
  %lo = arith.constant -87.0 : f32
  %ovf = arith.constant 88.72283935546875 : f32
  %unf = arith.constant -87.33654022216797 : f32
  %inf = arith.constant 0x7F800000 : f32
  %zero = arith.constant 0.0 : f32
  %half = arith.constant 0.5 : f32
  %one = arith.constant 1.0 : f32
  %log2e = arith.constant 1.44269504088896341 : f32
  %c1 = arith.constant 0.693359375 : f32
  %c2 = arith.constant -2.12194440e-4 : f32
  %p0 = arith.constant 1.9875691500e-4 : f32
  %p1 = arith.constant 1.3981999507e-3 : f32
  %p2 = arith.constant 8.3334519073e-3 : f32
  %p3 = arith.constant 4.1665795894e-2 : f32
  %p4 = arith.constant 1.6666665459e-1 : f32
  %p5 = arith.constant 5.0000001201e-1 : f32
  %bias = arith.constant 127 : i32
  %shift = arith.constant 23 : i32
  %xa = arith.minnumf %x, %hi : f32
  %xc = arith.maxnumf %xa, %lo : f32
  %t = arith.mulf %xc, %log2e : f32
  %t2 = arith.addf %t, %half : f32
  %n = math.floor %t2 : f32
  %r1 = arith.mulf %n, %c1 : f32
  %r2 = arith.subf %xc, %r1 : f32
  %r3 = arith.mulf %n, %c2 : f32
  %r = arith.subf %r2, %r3 : f32
  %q0 = arith.mulf %p0, %r : f32
  %q1 = arith.addf %q0, %p1 : f32
  %q2 = arith.mulf %q1, %r : f32
  %q3 = arith.addf %q2, %p2 : f32
  %q4 = arith.mulf %q3, %r : f32
  %q5 = arith.addf %q4, %p3 : f32
  %q6 = arith.mulf %q5, %r : f32
  %q7 = arith.addf %q6, %p4 : f32
  %q8 = arith.mulf %q7, %r : f32
  %q9 = arith.addf %q8, %p5 : f32
  %rr = arith.mulf %r, %r : f32
  %q10 = arith.mulf %q9, %rr : f32
  %q11 = arith.addf %q10, %r : f32
  %p = arith.addf %q11, %one : f32
  %ni = arith.fptosi %n : f32 to i32
  %eb = arith.addi %ni, %bias : i32
  %e = arith.shli %eb, %shift : i32
  %pow2 = arith.bitcast %e : i32 to f32
  %y = arith.mulf %p, %pow2 : f32
  %big = arith.cmpf ogt, %x, %ovf : f32
  %small = arith.cmpf olt, %x, %unf : f32
  %nan = arith.cmpf uno, %x, %x : f32
  %y1 = arith.select %big, %inf, %y : f32
  %y2 = arith.select %small, %zero, %y1 : f32
  %y3 = arith.select %nan, %x, %y2 : f32
  return %y3 : f32
}

func.func private @__tf_tanhf(%x: f32) -> f32 {
  %one = arith.constant 1.0 : f32
  %mtwo = arith.constant -2.0 : f32
  %third = arith.constant 0.333333343 : f32
  %tiny = arith.constant 0.00390625 : f32
  %ax = math.absf %x : f32
  %m = arith.mulf %ax, %mtwo : f32
  %e = func.call @__tf_expf(%m) : (f32) -> f32
  %num = arith.subf %one, %e : f32
  %den = arith.addf %one, %e : f32
  %q = arith.divf %num, %den : f32
  %t = math.copysign %q, %x : f32
  %x2 = arith.mulf %x, %x : f32
  %x3 = arith.mulf %x2, %x : f32
  %c = arith.mulf %x3, %third : f32
  %s = arith.subf %x, %c : f32
  %isSmall = arith.cmpf olt, %ax, %tiny : f32
  %r = arith.select %isSmall, %s, %t : f32
  return %r : f32
}
"""

_CALLS = {"exp": "__tf_expf", "tanh": "__tf_tanhf"}
_PATTERN = re.compile(r"math\.(exp|tanh) (%[\w#]+)(?: fastmath<[\w,]+>)? : f32\b")


def substitute(text: str) -> str:
    """Rewrite scalar f32 math.exp/math.tanh into calls and append the library to the module."""
    new, count = _PATTERN.subn(lambda m: f"func.call @{_CALLS[m.group(1)]}({m.group(2)}) : (f32) -> f32", text)
    if not count:
        return text
    return new.rstrip().rstrip("}") + LIB + "\n}\n"
