"""Test-session set-up shared by every test module.

Without CUDA, Triton kernels run in Triton's interpreter. TRITON_INTERPRET must
be set before any kernel is decorated, i.e. before the first test module
imports one: doing it per module breaks as soon as another module imported
Triton first ("0 active drivers").

The top-level folders kernels/ and models/ install as titan_mok.kernels and
titan_mok.models (DESIGN §2). With the repo root first on sys.path, kernels/
would also shadow the PyPI package `kernels`, which transformers >= 5.25
imports. `python -m pytest` puts the working directory first, so the root is
moved to the end here; pytest's append import mode (pyproject.toml) puts it
there too. It stays on the path: mp.spawn children import test modules by name.
"""

import os
import sys

# Under Triton's interpreter tl.dot is NumPy's matmul, and multithreaded OpenBLAS splits a product among its
# threads by the tile's shape: a row's sum could then depend on the rows beside it in the tile (one bf16 ulp in
# test_triton_bitwise_run_to_run_and_row_invariant on a 2-core machine, NOTES.md session 40), which the tests would
# blame on the kernel. One thread sums every row alike. OpenBLAS reads this when NumPy first loads, so it goes before
# torch; if something loaded NumPy earlier without it, the interpreter's set-up below says so.
_BLAS_THREADS_SET_TOO_LATE = "numpy" in sys.modules and os.environ.get("OPENBLAS_NUM_THREADS") != "1"
os.environ["OPENBLAS_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.torchrun import REPO  # noqa: E402

sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != str(REPO)] + [str(REPO)]

if not torch.cuda.is_available():
    if _BLAS_THREADS_SET_TOO_LATE:
        raise RuntimeError("tests/conftest.py: NumPy was loaded before OPENBLAS_NUM_THREADS=1 could be set (by a pytest "
                           "plugin?); run with OPENBLAS_NUM_THREADS=1 in the environment")
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

    _interpreter_numpy_shim()


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
