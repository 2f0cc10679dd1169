"""benchmarks.tools.write_tiles' store kernel against its reference (Triton's interpreter on the CPU; its timing needs a GPU)."""

import pytest
import torch

from benchmarks.tools.write_tiles import write_tiles, written_reference


@pytest.mark.parametrize("evict_first", [False, True])
def test_every_element_written_in_partial_tiles_and_runs(evict_first):
    """Partial feature and K tiles, K runs of 2 tiles over 3 (the last run short), fewer programs than jobs."""
    c = torch.zeros(3, 40, 72, dtype=torch.bfloat16)
    write_tiles(c, 16, 32, 2, programs=4, evict_first=evict_first, num_warps=4)
    assert torch.equal(c, written_reference(3, 40, 72))


def test_a_contiguous_view_is_one_expert():
    c = torch.zeros(2, 16, 64, dtype=torch.bfloat16)
    write_tiles(c.view(1, -1, 32), 16, 32, 1, programs=2, num_warps=4)
    assert torch.equal(c, torch.ones_like(c))


def test_rejects_what_it_cannot_write():
    with pytest.raises(ValueError, match=r"c_ENK must be contiguous bfloat16 \[E, N, K\], got torch.float32 \(2, 3\)"):
        write_tiles(torch.zeros(2, 3), 16, 16, 1, programs=1)


@pytest.mark.parametrize("tiles, message", [("12x256", "BN and BK must be powers of two"), ("128", "is not BNxBK")])
def test_bad_tiles_named(monkeypatch, capsys, tiles, message):
    import sys

    from benchmarks.tools import write_tiles

    monkeypatch.setattr(sys, "argv", ["write_tiles", "--tiles", f"128x256,{tiles}"])
    with pytest.raises(SystemExit):
        write_tiles.main()
    err = capsys.readouterr().err
    assert f"--tiles: '{tiles}'" in err and message in err, err
