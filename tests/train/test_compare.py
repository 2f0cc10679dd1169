"""titan_mok.compare on real runs: three short trainings (2 ranks, gloo, W&B offline),
their W&B transaction logs read back with W&B's own reader, checked against the
JSONL twin; then the comparison report, its JSON, its plot and its errors. The
same runs' final weights: same seed, same bits."""

import json
import math
import struct
import subprocess
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests import torchrun
from titan_mok import compare

CONFIG = "train_configs/kimi_k2_7_code/debug.toml"
STEPS = 4
SEEDS = {"a": 7, "b": 7, "c": 8}
LOSS = "loss_metrics/global_avg_loss"
pytestmark = pytest.mark.slow


def _train(folder: Path, tag: str) -> None:
    torchrun.run(
        "titan_mok.train", CONFIG, "--training.steps", str(STEPS), "--metrics.log_freq", "1",
        "--debug.seed", str(SEEDS[tag]), "--job.dump_folder", str(folder), "--metrics.enable_wandb",
        "--metrics.wandb_run_name", f"seed{SEEDS[tag]}-{tag}", "--metrics.wandb_group", "test-compare",
        "--metrics.wandb_tags", "ci,compare", "--metrics.wandb_notes", "a short CPU run",
        "--checkpoint.enable", "--checkpoint.interval", str(STEPS), "--checkpoint.last_save_model_only",
        "--checkpoint.export_dtype", "float32",
    )


def _one(folder: Path, pattern: str) -> Path:
    found = sorted(folder.glob(pattern))
    assert len(found) == 1, f"{folder}/{pattern}: {found}"
    return found[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """tag → {"jsonl": metrics.jsonl, "wandb": the offline W&B run directory, "checkpoint": the last step's}."""
    root = tmp_path_factory.mktemp("runs")
    with pytest.MonkeyPatch.context() as env:
        for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_NAME", "WANDB_RUN_NAME", "WANDB_TAGS", "WANDB_RUN_TAGS",
                    "WANDB_NOTES", "WANDB_RUN_NOTES", "WANDB_RUN_GROUP", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_TEAM"):
            env.delenv(var, raising=False)
        for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
            env.setenv(var, str(root / "wandb-home"))
        with ThreadPoolExecutor(len(SEEDS)) as pool:
            list(pool.map(lambda tag: _train(root / tag, tag), SEEDS))
    return {
        tag: {"jsonl": _one(root / tag, "tb/*/metrics.jsonl"), "wandb": _one(root / tag, "tb/*/wandb/offline-run-*"),
              "checkpoint": root / tag / "checkpoint" / f"step-{STEPS}"}
        for tag in SEEDS
    }


@pytest.fixture(scope="module")
def report(runs, tmp_path_factory) -> dict:
    """`compare a b c --json --plot` on the three W&B run directories."""
    png = tmp_path_factory.mktemp("plot") / "runs.png"
    out = _compare(*(str(runs[t]["wandb"]) for t in SEEDS), "--json", "--plot", str(png))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _compare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "titan_mok.compare", *args], capture_output=True, text=True, timeout=300)


def _bits(value: float) -> bytes:
    return struct.pack("<d", value)


def _jsonl_series(path: Path) -> dict[int, dict[str, float]]:
    lines = path.read_text().splitlines()
    return {r["step"]: r["metrics"] for r in map(json.loads, lines[1:])}


def test_wandb_run_is_offline_with_toml_settings_and_resolved_config(runs):
    proc = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(_one(runs["c"]["wandb"], "run-*.wandb"))],
        capture_output=True, text=True, timeout=300, check=True,
    )
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert (run["display_name"], run["run_group"], run["tags"], run["notes"], run["project"]) == (
        "seed8-c", "test-compare", ["ci", "compare"], "a short CPU run", "titan-mok"
    )
    assert run["telemetry"]["feature"]["offline"] is True
    config = run["config"]["update"]
    assert (config["mok"]["backend"], config["mok"]["precision"]) == ("mok", "bf16")
    assert config["debug"]["seed"] == 8 and config["training"]["steps"] == STEPS
    assert config["mok_run"]["world_size"] == 2
    sha = config["mok_run"]["git_sha"]
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=torchrun.REPO, capture_output=True).returncode == 0:
        # the commit the run started from (HEAD itself, or an ancestor if a commit landed since)
        ancestor = subprocess.run(["git", "merge-base", "--is-ancestor", sha, "HEAD"], cwd=torchrun.REPO)
        assert len(sha) == 40 and ancestor.returncode == 0, sha
    else:
        assert sha == "unknown"
    assert config["mok_run"]["mfu_peak_tflops"] is None and "not meaningful" in config["mok_run"]["mfu_peak_source"]
    # the JSONL header carries the same config
    assert compare.config_diff([compare.read_jsonl(runs["c"]["jsonl"]), compare.read_wandb_file(
        _one(runs["c"]["wandb"], "run-*.wandb"))]) == {}


def test_wandb_history_equals_jsonl_bit_for_bit(runs):
    for tag in SEEDS:
        from_wandb = compare.load_run(str(runs[tag]["wandb"])).series
        from_jsonl = compare.load_run(str(runs[tag]["jsonl"])).series
        assert from_wandb.keys() == from_jsonl.keys()
        for key, steps in from_jsonl.items():
            assert sorted(steps) == list(range(1, STEPS + 1)), key
            assert all(_bits(from_wandb[key][s]) == _bits(v) for s, v in steps.items()), key


def test_moe_series_and_loss_checksum(runs):
    series = _jsonl_series(runs["a"]["jsonl"])
    checksum = 0
    for step, metrics in sorted(series.items()):
        checksum = zlib.crc32(struct.pack("<d", metrics[LOSS]), checksum)
        assert metrics["determinism/loss_checksum"] == checksum
        assert metrics["moe/tokens_dropped"] == 0
        layers = {k.split("/")[1] for k in metrics if k.startswith("moe/layers_")}
        assert len(layers) >= 2, layers  # the Kimi debug flavor: 1 dense + MoE layers
        for layer in layers:
            assert metrics[f"moe/{layer}/tokens_dropped"] == 0
            assert metrics[f"moe/{layer}/load_max_over_mean"] >= 1 >= metrics[f"moe/{layer}/load_min_over_mean"] >= 0
            assert 0 < metrics[f"moe/{layer}/router_entropy"] <= math.log(8) + 1e-6  # 8 experts
            assert math.isfinite(metrics[f"moe/{layer}/aux_loss"]) and metrics[f"moe/{layer}/bias_norm"] >= 0
        assert 0 < metrics["moe/time_share"] < 1
        assert math.isnan(metrics["mfu(%)"]) and metrics["throughput(tps)"] > 0


def test_same_seed_curves_are_identical(report):
    same = report["curves"][LOSS][0]
    assert same == {"run": 1, "identical": True, "steps_compared": STEPS}


def test_same_seed_runs_end_with_bitwise_equal_weights(runs, tmp_path):
    for tag in SEEDS:
        dcp_to_torch_save(runs[tag]["checkpoint"], tmp_path / f"{tag}.pt")
    a, b, c = (torch.load(tmp_path / f"{tag}.pt", weights_only=True) for tag in SEEDS)
    assert a.keys() == b.keys() and len(a) > 10
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"weights differ between same-seed runs: {different[:5]}"
    assert any(not torch.equal(a[k], c[k]) for k in a), "a different seed gave the same weights"


def test_different_seed_reports_the_first_divergent_step(report, runs):
    a, c = _jsonl_series(runs["a"]["jsonl"]), _jsonl_series(runs["c"]["jsonl"])
    step = next(s for s in sorted(a) if _bits(a[s][LOSS]) != _bits(c[s][LOSS]))
    diff = report["curves"][LOSS][1]
    assert (diff["run"], diff["identical"], diff["first_divergent_step"]) == (2, False, step)
    assert diff["values"] == [a[step][LOSS], c[step][LOSS]]
    assert diff["abs_diff"] == abs(c[step][LOSS] - a[step][LOSS])
    assert diff["max_abs_diff"] == max(abs(c[s][LOSS] - a[s][LOSS]) for s in a)


def test_json_numbers_equal_those_from_the_jsonl(report, runs):
    series = [_jsonl_series(runs[t]["jsonl"]) for t in SEEDS]
    for key, best in ((LOSS, min), ("throughput(tps)", max)):
        expected = []
        for s in series:
            values = [s[step][key] for step in sorted(s)]
            expected.append({"final": values[-1], "mean": math.fsum(values) / len(values), "best": best(values)})
        for e in expected:
            e.update({f"{k}_ratio": e[k] / expected[0][k] for k in ("final", "mean", "best")})
        assert report["metrics"][key] == {"common_steps": STEPS, "per_run": expected}
    # MFU is NaN on CPU: null in the JSON
    assert all(row["mean"] is None and row["mean_ratio"] is None for row in report["metrics"]["mfu(%)"]["per_run"])


def test_config_differences(report):
    diff = report["config_diff"]
    assert diff["debug.seed"] == [7, 7, 8]
    assert diff["metrics.wandb_run_name"] == ["seed7-a", "seed7-b", "seed8-c"]
    assert "training.steps" not in diff and "mok.backend" not in diff


def test_plot_png(report, runs, tmp_path):
    with Image.open(report["plot"]) as image:
        image.load()
        assert image.format == "PNG" and image.size == (3 * 500, 400)  # loss, tps, mfu panels
    one = tmp_path / "loss.png"
    assert _compare(str(runs["a"]["jsonl"]), str(runs["c"]["jsonl"]), "--metric", "loss", "--plot", str(one)).returncode == 0
    with Image.open(one) as image:
        image.load()
        assert image.size == (500, 400)


def test_text_report(runs):
    out = _compare(*(str(runs[t]["jsonl"]) for t in SEEDS), "--metric", "loss", "--metric", "grad_norm")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "#1 seed7-b" in text and "#2 seed8-c" in text
    assert f"{LOSS}: #1 bitwise identical over {STEPS} common steps" in text
    assert f"{LOSS}: #2 diverges at step" in text and "grad_norm: #2 diverges at step" in text
    assert "debug.seed" in text


def _write_jsonl(path: Path, header: str, steps: range) -> Path:
    path.write_text(header + "".join(json.dumps({"step": s, "metrics": {LOSS: 1.0 / s}}) + "\n" for s in steps))
    return path


@pytest.mark.parametrize("case", ["missing", "not_json", "empty_dir", "no_common_steps", "unknown_metric",
                                  "bad_wandb_file", "remote_without_credentials", "unwritable_plot"])
def test_bad_input_gives_a_message_not_a_traceback(case, runs, tmp_path, monkeypatch):
    header = runs["a"]["jsonl"].read_text().splitlines()[0] + "\n"
    (tmp_path / "empty").mkdir()
    good = str(runs["a"]["jsonl"])
    args, message = {
        "missing": ([good, str(tmp_path / "nope")], "no such file or directory"),
        "not_json": ([good, str(_write_jsonl(tmp_path / "x.jsonl", header + "{oops\n", range(0)))], "x.jsonl:2: not a JSON line"),
        "empty_dir": ([good, str(tmp_path / "empty")], "neither a W&B run directory"),
        "no_common_steps": (
            [str(_write_jsonl(tmp_path / "p.jsonl", header, range(1, 4))), str(_write_jsonl(tmp_path / "q.jsonl", header, range(5, 7))),
             "--metric", "loss"],
            "no common steps for 'loss_metrics/global_avg_loss' (#0: steps 1–3 (3); #1: steps 5–6 (2))",
        ),
        "unknown_metric": ([good, "--metric", "nope"], "unknown metric 'nope'"),
        "bad_wandb_file": ([good, str(_write_jsonl(tmp_path / "run-x.wandb", "", range(1, 2)))], "W&B's reader failed"),
        "remote_without_credentials": ([good, "someone/project/run123"], "fetching it as a W&B run"),
        "unwritable_plot": ([good, "--plot", str(tmp_path / "no" / "dir" / "p.png")], "--plot"),
    }[case]
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc credentials either
    out = _compare(*args)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and message in out.stderr, out.stderr
