"""Stage ``mathlib``: exp and tanh as plain f32 arithmetic, so that loops using them vectorise.

Why: the JIT has no vector math library, so ``math.exp`` lowers to a scalar ``expf`` call per
element and sigmoid/silu/gelu loops stay scalar. Here each ``math.exp``/``math.tanh`` on f32
becomes a call to a private function below, written in arith ops; the ``inline`` stage
inlines them into the loops.

exp: Cody–Waite range reduction x = n·ln2 + r, |r| ≤ ln2/2, a degree-6 minimax polynomial
(Cephes expf, ≈1 ulp), 2ⁿ built in the exponent bits. Over/underflow and NaN as IEEE.
tanh: sign(x)·(1 − e)/(1 + e) with e = exp(−2|x|); x − x³/3 below |x| < 2⁻⁸ (no cancellation).
sin, cos: x = n·π/2 + r reduced in f64 (n = round(x·2/π), r by three FMAs with π/2 split into
three doubles: exact enough for |x| < TRIG_BOUND, see below), then the Cephes sinf/cosf
polynomials on |r| ≤ π/4 in f32 (fma and roundeven as LLVM intrinsics: the ``llvm`` stage's
math-expand-ops would split math.fma into a rounded multiply and add) and the quadrant n mod 4 picks ±sin r or ±cos r. Inf and NaN
give NaN. |x| ≥ TRIG_BOUND is outside this reduction's accuracy: ``graph.py`` makes every
kernel that uses these functions count such arguments and recomputes the call in ATen if
there are any (libm reduces exactly), so results are never wrong, only slower there.
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

TRIG = r"""
func.func private @__tf_trigf(%x: f32, %off: i64) -> f32 {
  %twoopi = arith.constant 0.6366197723675814 : f64
  %p1 = arith.constant -1.5707963267948966 : f64
  %p2 = arith.constant -6.123233995736766e-17 : f64
  %p3 = arith.constant 1.4973849048591698e-33 : f64
  %quarter = arith.constant 0.25 : f64
  %four = arith.constant 4.0 : f64
  %zero = arith.constant 0.0 : f64
  %bound = arith.constant TRIG_BOUND : f32
  %nanv = arith.constant 0x7FC00000 : f32
  %one = arith.constant 1.0 : f32
  %mhalf = arith.constant -0.5 : f32
  %s0 = arith.constant -1.9515295891e-4 : f32
  %s1 = arith.constant 8.3321608736e-3 : f32
  %s2 = arith.constant -1.6666654611e-1 : f32
  %c0 = arith.constant 2.443315711809948e-5 : f32
  %c1 = arith.constant -1.388731625493765e-3 : f32
  %c2 = arith.constant 4.166664568298827e-2 : f32
  %i1 = arith.constant 1 : i64
  %i2 = arith.constant 2 : i64
  %i3 = arith.constant 3 : i64
  %zi = arith.constant 0 : i64
  %inf = arith.constant 0x7F800000 : f32
  %ax = math.absf %x : f32
  %ok = arith.cmpf olt, %ax, %bound : f32
  %xs = arith.select %ok, %x, %one : f32
  %xd = arith.extf %xs : f32 to f64
  %t = arith.mulf %xd, %twoopi : f64
  %n = llvm.intr.roundeven(%t) : (f64) -> f64
  %ra = llvm.intr.fma(%n, %p1, %xd) : (f64, f64, f64) -> f64
  %rb = llvm.intr.fma(%n, %p2, %ra) : (f64, f64, f64) -> f64
  %rc = llvm.intr.fma(%n, %p3, %rb) : (f64, f64, f64) -> f64
  %n4 = arith.mulf %n, %quarter : f64
  %fl = math.floor %n4 : f64
  %m4 = arith.mulf %fl, %four : f64
  %qd = arith.subf %n, %m4 : f64
  %qi = arith.fptosi %qd : f64 to i64
  %q0 = arith.addi %qi, %off : i64
  %q = arith.andi %q0, %i3 : i64
  %r = arith.truncf %rc : f64 to f32
  %z = arith.mulf %r, %r : f32
  %sa = arith.mulf %s0, %z : f32
  %sb = arith.addf %sa, %s1 : f32
  %sc = arith.mulf %sb, %z : f32
  %sd = arith.addf %sc, %s2 : f32
  %se = arith.mulf %sd, %z : f32
  %sf = arith.mulf %se, %r : f32
  %sinr = arith.addf %sf, %r : f32
  %ca = arith.mulf %c0, %z : f32
  %cb = arith.addf %ca, %c1 : f32
  %cc = arith.mulf %cb, %z : f32
  %cd = arith.addf %cc, %c2 : f32
  %ce = arith.mulf %cd, %z : f32
  %cf = arith.mulf %ce, %z : f32
  %cg = arith.mulf %z, %mhalf : f32
  %ch = arith.addf %cf, %cg : f32
  %cosr = arith.addf %ch, %one : f32
  %odd = arith.andi %q, %i1 : i64
  %isodd = arith.cmpi ne, %odd, %zi : i64
  %neg = arith.andi %q, %i2 : i64
  %isneg = arith.cmpi ne, %neg, %zi : i64
  %v = arith.select %isodd, %cosr, %sinr : f32
  %nv = arith.negf %v : f32
  %w = arith.select %isneg, %nv, %v : f32
  %fin = arith.cmpf one, %ax, %inf : f32
  %good = arith.andi %ok, %fin : i1
  %res = arith.select %good, %w, %nanv : f32
  return %res : f32
}

func.func private @__tf_sinf(%x: f32) -> f32 {
  %q = arith.constant 0 : i64
  %y = func.call @__tf_trigf(%x, %q) : (f32, i64) -> f32
  return %y : f32
}

func.func private @__tf_cosf(%x: f32) -> f32 {
  %q = arith.constant 1 : i64
  %y = func.call @__tf_trigf(%x, %q) : (f32, i64) -> f32
  return %y : f32
}
"""

# |x| below this: the f64 reduction leaves an absolute error in r of about n·2⁻¹⁰⁶ + 2⁻⁵³·|r|,
# < 2⁻⁷⁵ here, far below an f32 ulp of any r an f32 x can produce (tests/backends/test_mlir_ops.py
# checks arguments next to multiples of π/2 up to the bound against float64).
TRIG_BOUND = float(1 << 30)
TRIG = TRIG.replace("TRIG_BOUND", repr(TRIG_BOUND))

_CALLS = {"exp": "__tf_expf", "tanh": "__tf_tanhf", "sin": "__tf_sinf", "cos": "__tf_cosf"}
_PATTERN = re.compile(r"math\.(exp|tanh|sin|cos) (%[\w#]+)(?: fastmath<[\w,]+>)? : f32\b")


def _call(m) -> str:
    return f"func.call @{_CALLS[m.group(1)]}({m.group(2)}) : (f32) -> f32"


def substitute(text: str) -> str:
    """Rewrite scalar f32 math.exp/tanh/sin/cos into calls and append the library to the module."""
    new, count = _PATTERN.subn(_call, text)
    if not count:
        return text
    return new.rstrip().rstrip("}") + LIB + TRIG + "\n}\n"
