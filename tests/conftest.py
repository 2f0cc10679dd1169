"""Test-session set-up shared by every test module.

Without CUDA, Triton kernels run in Triton's interpreter. TRITON_INTERPRET must
be set before any kernel is decorated, i.e. before the first test module
imports one: doing it per module breaks as soon as another module imported
Triton first ("0 active drivers").

The top-level folders kernels/ and models/ install as titan_mok.kernels and
titan_mok.models (docs/design.md §2). With the repo root first on sys.path, kernels/
would also shadow the PyPI package `kernels`, which transformers >= 5.25
imports. `python -m pytest` puts the working directory first, so the root is
moved to the end here; pytest's append import mode (pyproject.toml) puts it
there too. It stays on the path: mp.spawn children import test modules by name.
"""

import os
import sys

import pytest
import torch

from tests.torchrun import REPO

sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != str(REPO)] + [str(REPO)]

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

    def _interpreter_numpy_shim():
        """Triton 3.6's interpreter holds scalars as 1-element arrays and int()s them for loop
        bounds, which NumPy >= 2.4 rejects; index through the single element instead."""
        from triton.runtime import interpreter

        patch_tensor = interpreter._patch_lang_tensor

        def patched(tensor, scope):
            patch_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        interpreter._patch_lang_tensor = patched

    def _interpreter_exact_dot():
        """The interpreter's tl.dot is NumPy's float32 matmul, whose sums OpenBLAS orders by the operands' shapes
        and its threads: a tile's element then differs in its last bit between tile shapes (1 element of 8192 in
        test_config_ab_runs_every_kind, one run in ~7) and between a row's neighbours,
        which the bit-for-bit tests would blame on the kernel; on the GPU an element's MMA order is the kernel's.
        In float64 a tile's products are exact (bf16, fp16 and fp32 operands alike) and their sum's rounding error,
        in any order, about K * 2^-53 of the terms' magnitudes, lies far below a float32 ulp of the result (but
        under near-total cancellation or on a rounding boundary: not met in these tests), so each order rounds to
        the same float32 and the interpreter's bits follow the kernel's own loop, not BLAS."""
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter

        blas_dot = interpreter.InterpreterBuilder.create_dot

        def exact_dot(self, a, b, d, *args):
            if d.data.dtype != np.float32:
                return blas_dot(self, a, b, d, *args)
            # blas_dot itself on a float64 accumulator of -0.0, which adds nothing, not even a zero's sign (so its
            # operand handling, FP8 included, stays its own)
            zero = interpreter.TensorHandle(np.full(d.data.shape, -0.0), tl.float64)
            products = blas_dot(self, a, b, zero, *args).data
            return interpreter.TensorHandle(products.astype(np.float32) + d.data, d.dtype.scalar)

        interpreter.InterpreterBuilder.create_dot = exact_dot

    def _interpreter_patch_once_per_launch():
        """A launch in the interpreter swaps triton.language's builtins for interpreted ones (restored when it ends),
        and then every call of a @triton.jit function inside it patches them again: a walk over every member of
        each language module that swaps nothing (the members are already swapped) and re-sets the tensor's and
        the module's few attributes to equal ones. In the megakernel tests that walk is a quarter of the time.
        Inside a launch, a call whose language modules the launch has patched skips it; any other call (a module
        the launch did not patch) is patched as before."""
        from triton.runtime import interpreter

        patch_lang, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
        patched: list[set[int]] = []  # per launch in progress: ids of the language modules it patched

        def langs(fn) -> set[int]:
            return {id(v) for v in fn.__globals__.values() if v is interpreter.tl or v is interpreter.tl.core}

        def patch_lang_once(fn):
            if patched and langs(fn) <= patched[-1]:
                return interpreter._LangPatchScope()
            scope = patch_lang(fn)
            if patched:
                patched[-1] |= langs(fn)
            return scope

        def launch_patching_once(self, *args, **kwargs):
            patched.append(set())
            try:
                return launch(self, *args, **kwargs)
            finally:
                patched.pop()

        interpreter._patch_lang = patch_lang_once
        interpreter.GridExecutor.__call__ = launch_patching_once

    _interpreter_numpy_shim()
    _interpreter_exact_dot()
    _interpreter_patch_once_per_launch()


@pytest.fixture
def one_rank_gloo():
    """A 1-rank gloo process group in this process, destroyed afterwards."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
