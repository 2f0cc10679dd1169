"""python -m titan_mok.bench.e2e: its runs, its summary of a run's metrics.jsonl, its arguments;
and, on CPU, one invocation training Kimi's debug flavor with titan-mok (mok backend) and with
TorchTitan's own deepseek_v3 at the same dimensions (one process each, gloo, AMP bf16, full AC)."""

import json
import math
import os
import subprocess
import sys

import pytest

from tests.torchrun import REPO
from titan_mok.baseline import BASELINE_MODEL
from titan_mok.bench import e2e


def test_runs_per_model():
    assert [(r.label, r.model_name) for r in e2e.plan_runs("kimi_k2_7_code", torchtitan_backend=True)] == [
        ("titan-mok", "kimi_k2_7_code"), ("titan-mok, torchtitan backend", "kimi_k2_7_code"),
        ("TorchTitan deepseek_v3", BASELINE_MODEL)]
    for model in ("glm_5_2", "qwen3_5_397b_a17b", "deepseek_v4_pro"):  # no TorchTitan model has their attention
        assert [r.model_name for r in e2e.plan_runs(model, torchtitan_backend=False)] == [model]


def _jsonl(path, steps: dict[int, dict]) -> None:
    lines = [{"config": {"mok_run": {"device": "NVIDIA H100 80GB HBM3"}}, "run": {}}]
    lines += [{"step": s, "metrics": m} for s, m in steps.items()]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")


def test_summary_medians_after_warmup_and_peaks_over_all_steps(tmp_path):
    def step(tps, reserved, loss, moe=0.5, attention=0.25):
        return {"throughput(tps)": tps, "tflops": tps / 10, "mfu(%)": tps / 100, "time_metrics/end_to_end(s)": 1 / tps,
                "memory/max_reserved(GiB)": reserved, "memory/max_active(GiB)": reserved - 1,
                "loss_metrics/global_avg_loss": loss, "moe/time_share": moe, "attention/time_share": attention}

    path = tmp_path / "metrics.jsonl"
    _jsonl(path, {1: step(10.0, 70.0, 9.0), 2: step(400.0, 60.0, 8.0, moe=0.4), 3: step(100.0, 61.0, 7.0),
                  4: step(300.0, 62.0, 6.5, moe=0.6)})
    result = e2e.Result("x", "kimi_k2_7_code", 0, "log")
    e2e.summarize(result, path, warmup=1)
    assert result.steps_measured == [2, 3, 4] and result.device == "NVIDIA H100 80GB HBM3"
    assert (result.tokens_per_s_per_gpu, result.tflops_per_gpu, result.mfu_pct) == (300.0, 30.0, 3.0)
    assert (result.peak_reserved_gib, result.peak_active_gib) == (70.0, 69.0)  # the warm-up step's peak counts
    assert (result.final_step, result.final_loss) == (4, 6.5)
    assert (result.moe_time_share, result.attention_time_share, result.rest_time_share) == (0.5, 0.25, 0.25)

    _jsonl(path, {1: step(10.0, 70.0, 9.0)})
    e2e.summarize(result := e2e.Result("x", "kimi_k2_7_code", 0, "log"), path, warmup=1)
    assert "no step after the 1 warm-up steps" in result.error


@pytest.mark.parametrize("argv, message", [
    (["--model", "kimi_k2_7_code", "--steps", "5", "--warmup", "5"], "--warmup 5 must be in"),
    (["--model", "kimi_k2_7_code", "--nproc", "2", "--ep", "3"], "--ep 3 must divide --nproc 2"),
    (["--model", "kimi_k2_7_code", "--flavor", "huge"], "train_configs/kimi_k2_7_code/huge.toml: no such file"),
    (["--model", "kimi_k2_7_code", "--stepz", "3"], "unknown option '--stepz'"),
    (["--model", "kimi_k2_7_code", "--training.seq_len", "64", "stray"], "unexpected argument 'stray'"),
])
def test_argument_errors_name_the_option(argv, message, capsys):
    with pytest.raises(SystemExit):
        e2e.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_kimi_beside_torchtitan_deepseek_v3_on_cpu(tmp_path):
    out = tmp_path / "e2e"
    cmd = [sys.executable, "-m", "titan_mok.bench.e2e", "--model", "kimi_k2_7_code", "--flavor", "debug",
           "--steps", "3", "--warmup", "1", "--out", str(out), "--json", "--activation_checkpoint.mode", "full"]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    report = json.loads(proc.stdout)
    assert (report["baseline"], report["no_baseline"]) == (BASELINE_MODEL, None)
    ours, theirs = report["runs"]
    assert (ours["model_name"], theirs["model_name"]) == ("kimi_k2_7_code", BASELINE_MODEL)
    for run in (ours, theirs):
        assert run["error"] is None and run["final_step"] == 3 and math.isfinite(run["final_loss"])
        assert run["tokens_per_s_per_gpu"] > 0 and run["peak_reserved_gib"] > 0
        assert 0 < run["moe_time_share"] < 1 and 0 < run["attention_time_share"] < 1
    assert theirs["ratio_to_torchtitan"] == 1.0
    assert ours["ratio_to_torchtitan"] == ours["tokens_per_s_per_gpu"] / theirs["tokens_per_s_per_gpu"]
    # the second run built TorchTitan's model (its FLOP count logs its own parameter split); both ran under AMP
    logs = [open(run["log"]).read() for run in (ours, theirs)]
    assert f"Building {BASELINE_MODEL} debug" in logs[1] and "Total parameter count: dense" in logs[1]
    assert "Total parameter count: dense" not in logs[0]
    assert all("Mixed precision training is handled by AMP" in log for log in logs)
    table = (out / "report.txt").read_text()
    assert "TorchTitan deepseek_v3" in table and "titan-mok" in table


@pytest.mark.slow
def test_a_run_past_its_timeout_is_stopped_with_its_workers(tmp_path):
    args, overrides = e2e.parse_args(["--model", "kimi_k2_7_code", "--flavor", "debug", "--steps", "2",
                                      "--timeout", "3", "--out", str(tmp_path / "e2e")])
    folder = tmp_path / "e2e" / "run"
    result = e2e.launch(e2e.Run("titan-mok", "kimi_k2_7_code", []), args, folder, overrides)
    assert result.returncode == 124 and result.error.startswith("timed out after 3.0 s")
    # no process of the run is left: the group's leader (torchrun) was waited for, its workers killed
    for line in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout.splitlines():
        assert str(folder) not in line
