"""A fix for Triton's CPU interpreter (TRITON_INTERPRET=1) under NumPy ≥ 2.4.

Triton 3.6's interpreter turns a scalar kernel value into a Python int with
``int(handle.data)``, where ``data`` is a 1-element array; NumPy 2.4 made that a TypeError, so
every ``range(...)`` over a runtime bound inside a kernel fails (triton-lang/triton#9171, fixed
upstream by converting through ``squeeze()``). Applied only in interpreter mode, only when the
installed NumPy rejects the conversion, and only to that one attribute.
"""
from __future__ import annotations


def apply() -> None:
    from triton import knobs

    if not knobs.runtime.interpret:
        return
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
