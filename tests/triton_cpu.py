"""Triton's interpreter on the CPU, for tests of the GPU kernels on machines without a GPU.

conftest.py sets TRITON_INTERPRET=1 before triton is imported. `require_triton()` returns the kernels
module, skipping (failing under CI=true) when triton is not installed, and makes the interpreter's
loops with a bound read from memory work with numpy >= 2.4 (which refuses int() of a 1-element
array; the interpreter holds scalars as such arrays).
"""
import os

import pytest


def require_triton():
    from engine.model import kernels
    if kernels.triton is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("triton is not installed (the dev extra installs it); CI must run the kernel tests")
        pytest.skip("triton is not installed")
    if os.environ.get("TRITON_INTERPRET") == "1":
        import triton.runtime.interpreter as interpreter
        if not getattr(interpreter, "_scalar_index_patch", False):
            original = interpreter._patch_lang_tensor

            def patch(tensor, scope):
                original(tensor, scope)
                scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

            interpreter._patch_lang_tensor = patch
            interpreter._scalar_index_patch = True
    return kernels
