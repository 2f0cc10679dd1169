"""kernels/grouped_gemm.py's tile ends (one launch) equal the torch expression they replace, for any group count,
empty groups, int32 and int64 ends. CPU: Triton's interpreter."""

import pytest
import torch

from titan_mok.kernels.grouped_gemm import _tile_ends

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("num_groups", [1, 7, 384, 2049])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_tile_ends_equal_the_torch_expression(num_groups, dtype):
    gen = torch.Generator().manual_seed(num_groups)
    counts_E = torch.randint(0, 300, (num_groups,), generator=gen)
    counts_E[::3] = 0  # empty groups
    group_end_E = counts_E.cumsum(0).to(dtype).to(DEVICE)
    for rows_per_tile, tiles_per_rows in ((64, 1), (128, 7), (32, 1), (1, 3)):
        want = (torch.div(counts_E + rows_per_tile - 1, rows_per_tile, rounding_mode="floor") * tiles_per_rows)
        got = _tile_ends(group_end_E, rows_per_tile, tiles_per_rows)
        assert got.dtype == torch.int32
        assert torch.equal(got.cpu(), want.cumsum(0).to(torch.int32)), (rows_per_tile, tiles_per_rows)


def test_no_groups():
    assert _tile_ends(torch.zeros(0, dtype=torch.int32, device=DEVICE), 64, 1).shape == (0,)
