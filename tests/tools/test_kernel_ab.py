"""benchmarks.tools.kernel_ab: a baseline revision's kernels imported beside the working tree's, their bits compared (the
timing needs a GPU and is stubbed; the kernels run on Triton's interpreter at a tiny shape)."""

import json
import shutil
import sys

import pytest

from benchmarks.tools import config_ab, kernel_ab
from benchmarks.tools.grouped_ffn import Case
from tests.tools.test_config_ab import tracked_cpu_cases
from titan_mok import kernels as kernels_package
from titan_mok.kernels import grouped_gemm as gg
from titan_mok.kernels import tile_configs as tc

# the flat loop's store of a weight-gradient tile (both of its lines open this way)
WGRAD_STORE = "tl.store(c_rows + offs_k[None, :], _bf16_rne(acc),"


def _baseline_copy(tmp_path, edit=None):
    """A copy of the working tree's kernels/ folder, its grouped_gemm.py passed through edit."""
    folder = tmp_path / "base" / "kernels"
    shutil.copytree(kernels_package.__path__[0], folder, ignore=shutil.ignore_patterns("__pycache__"))
    if edit:
        path = folder / "grouped_gemm.py"
        path.write_text(edit(path.read_text()))
    return folder


def _run_tiny(monkeypatch, tmp_path, baseline, *flags, cases="EP=2 skewed", make_case=None):
    """The whole tool at a tiny shape on the interpreter, timing stubbed; its JSON lines."""
    monkeypatch.setattr(config_ab, "SHAPES", {"tiny": (128, 64, 8, 2)})
    monkeypatch.setattr(config_ab, "TOKENS_PER_GPU", 48)
    monkeypatch.setattr(kernel_ab, "SHAPES", {"tiny": (128, 64, 8, 2)})
    monkeypatch.setattr(kernel_ab, "Case", make_case or (lambda h, i, counts: Case(h, i, counts, dev="cpu")))
    monkeypatch.setattr(kernel_ab, "bench", lambda fn, rep_ms: (fn(), 1.0)[1])
    monkeypatch.setattr(kernel_ab.torch.cuda, "empty_cache", lambda: None)
    argv = ["kernel_ab", "--baseline", str(baseline), "--shapes", "tiny", "--cases", cases, "--rounds", "1",
            "--out", str(tmp_path), *flags]
    monkeypatch.setattr(sys, "argv", argv)
    kernel_ab.main()
    return [json.loads(line) for line in (tmp_path / "kernel_ab.jsonl").read_text().splitlines()[1:]]


def test_an_unchanged_baseline_keeps_the_bits(monkeypatch, tmp_path):
    """Every kind of grouped_mm and each weight's gradient, from the baseline's own modules (not the working
    tree's), bit for bit the working tree's; the baseline forgotten afterwards."""
    seen = []
    real = kernel_ab.gemm_makers
    monkeypatch.setattr(kernel_ab, "gemm_makers",
                        lambda c, args, kernels: (seen.append(kernels), real(c, args, kernels))[1])
    rows = _run_tiny(monkeypatch, tmp_path, _baseline_copy(tmp_path), "--precision", "bf16")
    kinds = [f"bf16/{k}@few_rows" for k in ("swiglu", "plain", "swiglu_bwd", "dual")]
    kinds += [f"wgrad/flat:{w}" for w in ("w_gate", "w_up", "w_down")]
    assert [r["kind"] for r in rows] == [r["baseline_kind"] for r in rows] == kinds
    assert all(r["bits_equal"] and r["working_ms"] == r["baseline_ms"] == 1.0 for r in rows)
    assert all(r["working/baseline"] == 1.0 for r in rows)
    (working_gg, _, working_tc), (baseline_gg, baseline_ffn, baseline_tc) = seen
    assert working_gg is gg and baseline_gg.__name__ == f"{kernel_ab.BASELINE_PACKAGE}.grouped_gemm"
    assert baseline_gg._grouped_wgrad_kernel is not gg._grouped_wgrad_kernel
    assert working_tc is tc and baseline_tc.H200 is not tc.H200 and baseline_gg.tile_configs is baseline_tc
    assert baseline_ffn.weight_operand.__module__ == f"{kernel_ab.BASELINE_PACKAGE}.grouped_ffn"
    assert not any(m.startswith(kernel_ab.BASELINE_PACKAGE) for m in sys.modules)


def test_each_case_is_released_before_the_next(monkeypatch, tmp_path):
    """Neither side's GEMMs hold a case's tensors once they are done (config_ab's test, for this tool)."""
    made = []
    rows = _run_tiny(monkeypatch, tmp_path, _baseline_copy(tmp_path), "--precision", "bf16", "--gemms", "wgrad",
                     cases="EP=2 skewed,EP=2 balanced", make_case=tracked_cpu_cases(made))
    assert len(made) == 2 and len(rows) == 6


def test_a_changed_baseline_kernel_shows_in_the_bits(monkeypatch, tmp_path):
    """A baseline whose weight-gradient kernel stores twice the tile: its three gradients differ, grouped_mm's
    kinds (the same kernels) do not."""
    def doubled(source):
        assert source.count(WGRAD_STORE) == 2, "the flat and row loops' stores moved: update WGRAD_STORE"
        return source.replace(WGRAD_STORE, "tl.store(c_rows + offs_k[None, :], _bf16_rne(acc * 2),")

    rows = _run_tiny(monkeypatch, tmp_path, _baseline_copy(tmp_path, doubled), "--precision", "bf16")
    assert [r["bits_equal"] for r in rows] == [True] * 4 + [False] * 3


def test_a_baseline_without_tile_configs_is_refused_by_name(monkeypatch, tmp_path, capsys):
    """A kernels/ from before tile_configs (its launchers called otherwise) cannot be compared: refused by name."""
    baseline = _baseline_copy(tmp_path)
    (baseline / "tile_configs.py").unlink()
    monkeypatch.setattr(sys, "argv", ["kernel_ab", "--baseline", str(baseline), "--precision", "bf16"])
    with pytest.raises(SystemExit):
        kernel_ab.main()
    assert "not a kernels/ folder with tile_configs (no tile_configs.py)" in capsys.readouterr().err


def test_gemms_pick_the_weight_gradients_only(monkeypatch, tmp_path):
    rows = _run_tiny(monkeypatch, tmp_path, _baseline_copy(tmp_path), "--precision", "mxfp8", "--gemms", "wgrad")
    assert [r["kind"] for r in rows] == [f"wgrad/flat:{w}" for w in ("w_gate", "w_up", "w_down")]
    assert all(r["bits_equal"] for r in rows)


def test_a_baseline_that_is_not_a_kernels_folder(monkeypatch, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    monkeypatch.setattr(sys, "argv", ["kernel_ab", "--baseline", str(tmp_path / "empty"), "--precision", "bf16"])
    with pytest.raises(SystemExit):
        kernel_ab.main()
    err = capsys.readouterr().err
    assert "not a kernels/ folder with tile_configs (no __init__.py, grouped_gemm.py, grouped_ffn.py, " \
           "tile_configs.py)" in err, err


def test_a_case_out_of_gpu_memory_is_skipped_by_name(monkeypatch, tmp_path, capsys):
    """A case whose operands do not fit the GPU (DeepSeek-V4-Pro EP=1 in MXFP8 on an 80 GB H100: 51 GB of bf16
    weights beside both sides' quantized copies) gets a "skipped" line naming it, its tensors are released, the next
    case still runs, and the exit status says so."""
    made = []
    real = kernel_ab.gemm_makers

    def gemm_makers(c, args, kernels):
        out = real(c, args, kernels)
        if len(made) == 1:
            raise kernel_ab.torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 5.25 GiB. GPU 0 has ...")
        return out

    monkeypatch.setattr(kernel_ab, "gemm_makers", gemm_makers)
    with pytest.raises(SystemExit, match=r"1 case\(s\) did not fit the GPU's memory"):
        _run_tiny(monkeypatch, tmp_path, _baseline_copy(tmp_path), "--precision", "bf16", "--gemms", "wgrad",
                  cases="EP=2 skewed,EP=2 balanced", make_case=tracked_cpu_cases(made))
    rows = [json.loads(line) for line in (tmp_path / "kernel_ab.jsonl").read_text().splitlines()[1:]]
    assert rows[0] == {"shape": "tiny", "case": "EP=2 skewed",
                       "skipped": "CUDA out of memory. Tried to allocate 5.25 GiB"}
    assert len(made) == 2 and [r["case"] for r in rows[1:]] == ["EP=2 balanced"] * 3
    assert all(r["bits_equal"] for r in rows[1:])


def test_each_side_holds_one_gemms_weights_at_a_time(monkeypatch, tmp_path):
    """MXFP8 weights are made per GEMM and dropped after it: at most a SwiGLU gate/up's two per side are alive (all
    six per side did not fit an 80 GB H100 at Kimi K2.7 EP=1), and the bits still match."""
    import weakref

    from benchmarks.tools import grouped_ffn

    made, most_alive = [], [0]
    real = grouped_ffn.weight_as_read

    def weight_as_read(*args, **kwargs):
        most_alive[0] = max(most_alive[0], sum(ref() is not None for ref in made))
        w = real(*args, **kwargs)
        made.append(weakref.ref(w))
        return w

    monkeypatch.setattr(grouped_ffn, "weight_as_read", weight_as_read)
    rows = _run_tiny(monkeypatch, tmp_path, _baseline_copy(tmp_path), "--precision", "mxfp8", "--gemms", "mm")
    assert [r["kind"] for r in rows] == [f"mxfp8/{k}@few_rows" for k in ("swiglu", "plain", "swiglu_bwd", "dual")]
    assert all(r["bits_equal"] for r in rows)
    assert len(made) == 2 * (3 + 6) and most_alive[0] == 3  # per side: the activations' three, then each kind's
