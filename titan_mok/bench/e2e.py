"""End-to-end training speed of titan-mok's model beside TorchTitan's own, from one invocation.

    python -m titan_mok.bench.e2e --model kimi_k2_7_code [--flavor one_gpu] [--steps 30] [--warmup N]
        [--nproc 1] [--ep 1] [--torchtitan-backend] [--out DIR] [--json] [--section.key value ...]

Each run is a real ``torchrun --nproc_per_node NPROC -m titan_mok.train`` subprocess, one after
the other, on the same TOML (default ``train_configs/<model>/<flavor>.toml``) with the same
overrides: the same tokens (the embedded ``tasks`` corpus, same seed), batch, sequence length,
parallelism (``--ep`` sets ``[parallelism] expert_parallel_degree``), activation checkpointing
and precision (on one GPU there is no FSDP, so TorchTitan's mixed precision is AMP: autocast to
``mixed_precision_param`` for both).

- ``titan-mok``: the model with ``[mok] backend = "mok"``.
- ``titan-mok, torchtitan backend`` (``--torchtitan-backend``): the same model with ``[mok] backend =
  "torchtitan"``: titan-mok's router, shared expert and combine around TorchTitan's GroupedExperts
  and ExpertParallel, the A/B where only the routed experts' path differs.
- ``TorchTitan deepseek_v3`` (Kimi K2.7 Code only): TorchTitan 0.2.2's own model, MoE,
  ExpertParallel and parallelize function at the same flavor's dimensions
  (``titan_mok.baseline``: the registered ``deepseek_v3_titan_mok_dims``), trained through the
  same entry (which applies ``cpu_compat`` on CPU) with titan-mok's data, tokenizer and metrics
  processor. The other models' attention has no TorchTitan equivalent: they run alone, and the
  report says so.

Reported per run, from the run's ``metrics.jsonl`` (logged every step, rank 0): tokens/s per GPU,
TFLOP/s per GPU and MFU (each by its own model's FLOPs per token; the two models' counts are
equal), all as medians over the steps after ``--warmup``; peak memory (max over steps of
TorchTitan's ``memory/max_reserved`` and ``max_active``); the loss at the last step; and where
the time goes (``titan_mok.time_share``, medians): the MoE layers, the attention, the rest. The
ratio column divides each run's tokens/s by the TorchTitan run's. A table on stdout, or with
``--json`` one JSON document; both are also written to ``<out>/report.txt`` and ``report.json``
beside each run's folder (its TOML dump folder: log ``train.log``, ``tb/*/metrics.jsonl``).
"""

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

from titan_mok.baseline import BASELINE_MODEL, MAPPED_MODEL, NO_BASELINE
from titan_mok.registry import MODELS


@dataclass
class Run:
    label: str
    model_name: str
    """``[model] name`` of the run."""
    overrides: list[str]
    """The run's own overrides, after the common ones."""


@dataclass
class Result:
    label: str
    model_name: str
    returncode: int
    log: str
    metrics_jsonl: str | None = None
    device: str | None = None
    steps_logged: int = 0
    steps_measured: list[int] = field(default_factory=list)
    tokens_per_s_per_gpu: float = math.nan
    tflops_per_gpu: float = math.nan
    mfu_pct: float = math.nan
    step_time_s: float = math.nan
    peak_reserved_gib: float = math.nan
    peak_active_gib: float = math.nan
    final_step: int | None = None
    final_loss: float = math.nan
    moe_time_share: float = math.nan
    attention_time_share: float = math.nan
    rest_time_share: float = math.nan
    ratio_to_torchtitan: float = math.nan
    error: str | None = None


def plan_runs(model: str, torchtitan_backend: bool) -> list[Run]:
    runs = [Run("titan-mok", model, ["--mok.backend", "mok"])]
    if torchtitan_backend:
        runs.append(Run("titan-mok, torchtitan backend", model, ["--mok.backend", "torchtitan"]))
    if model == MAPPED_MODEL:
        runs.append(Run("TorchTitan deepseek_v3", BASELINE_MODEL, []))
    return runs


def common_overrides(args, run_folder: Path) -> list[str]:
    return [
        "--model.flavor", args.flavor,
        "--training.steps", str(args.steps),
        "--parallelism.expert_parallel_degree", str(args.ep),
        "--metrics.log_freq", "1",
        "--metrics.enable_jsonl",
        "--metrics.moe_stats",
        "--metrics.disable_color_printing",
        "--job.dump_folder", str(run_folder),
    ]


def launch(run: Run, args, run_folder: Path, overrides: list[str]) -> Result:
    """One torchrun subprocess; its output goes to ``run_folder/train.log``."""
    run_folder.mkdir(parents=True)
    log = run_folder / "train.log"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
        "-m", "titan_mok.train", "--config", args.config, "--model.name", run.model_name,
        *common_overrides(args, run_folder), *overrides, *run.overrides,
    ]
    print(f"[e2e] {run.label}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out:
        # its own process group: on a timeout torchrun's workers go too (they hold the GPU's memory)
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            returncode = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            _end_group(proc)
            returncode = 124
    result = Result(run.label, run.model_name, returncode, str(log))
    if returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-30:]
        reason = f"timed out after {args.timeout} s" if returncode == 124 else f"exited {returncode}"
        result.error = f"{reason}; last lines of {log}:\n" + "\n".join(tail)
        print(f"[e2e] {run.label} {reason} (log: {log})", file=sys.stderr, flush=True)
        return result
    jsonls = sorted(run_folder.rglob("metrics.jsonl"))
    if len(jsonls) != 1:
        result.error = f"expected one metrics.jsonl under {run_folder}, found {[str(p) for p in jsonls]}"
        return result
    summarize(result, jsonls[0], args.warmup)
    return result


def _end_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the run's process group (torchrun stops its workers), SIGKILL to whatever is
    left after 30 s."""
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            pass
    proc.wait()


def read_jsonl(path: Path) -> tuple[dict, dict[int, dict]]:
    """(the header's config, step → metrics)."""
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    steps = {}
    for line in lines[1:]:
        record = json.loads(line)
        steps[record["step"]] = record["metrics"]
    return header, steps


def _median(steps: dict[int, dict], measured: list[int], key: str) -> float:
    values = [steps[s][key] for s in measured if key in steps[s]]
    return statistics.median(values) if values else math.nan


def summarize(result: Result, jsonl: Path, warmup: int) -> None:
    header, steps = read_jsonl(jsonl)
    result.metrics_jsonl = str(jsonl)
    result.device = header["config"].get("mok_run", {}).get("device")
    result.steps_logged = len(steps)
    result.steps_measured = [s for s in sorted(steps) if s > warmup]
    if not result.steps_measured:
        result.error = f"no step after the {warmup} warm-up steps in {jsonl} (steps logged: {sorted(steps)})"
        return
    m = result.steps_measured
    result.tokens_per_s_per_gpu = _median(steps, m, "throughput(tps)")
    result.tflops_per_gpu = _median(steps, m, "tflops")
    result.mfu_pct = _median(steps, m, "mfu(%)")
    result.step_time_s = _median(steps, m, "time_metrics/end_to_end(s)")
    result.peak_reserved_gib = max(v.get("memory/max_reserved(GiB)", math.nan) for v in steps.values())
    result.peak_active_gib = max(v.get("memory/max_active(GiB)", math.nan) for v in steps.values())
    result.final_step = max(steps)
    result.final_loss = steps[result.final_step]["loss_metrics/global_avg_loss"]
    result.moe_time_share = _median(steps, m, "moe/time_share")
    result.attention_time_share = _median(steps, m, "attention/time_share")
    result.rest_time_share = 1.0 - result.moe_time_share - result.attention_time_share


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def format_report(report: dict) -> str:
    lines = [
        f"e2e: {report['model']} / {report['flavor']}, {report['nproc']} process(es), EP {report['ep']}, "
        f"{report['steps']} steps (medians over steps {report['warmup'] + 1}-{report['steps']}), "
        f"config {report['config']} {' '.join(report['overrides'])}".rstrip(),
        f"device: {report['device']}",
        f"{'run':<31} {'tokens/s/GPU':>12} {'ratio':>6} {'TFLOP/s':>8} {'MFU %':>6} {'step s':>7} "
        f"{'peak GiB':>8} {'loss@end':>8} {'moe':>5} {'attn':>5} {'rest':>5}",
    ]
    for r in report["runs"]:
        if r["error"] is not None:
            lines.append(f"{r['label']:<31} FAILED: {r['error'].splitlines()[0]}")
            continue
        lines.append(
            f"{r['label']:<31} {_fmt(r['tokens_per_s_per_gpu'], ',.0f'):>12} {_fmt(r['ratio_to_torchtitan'], '.3f'):>6} "
            f"{_fmt(r['tflops_per_gpu'], '.1f'):>8} {_fmt(r['mfu_pct'], '.1f'):>6} {_fmt(r['step_time_s'], '.3f'):>7} "
            f"{_fmt(r['peak_reserved_gib'], '.1f'):>8} {_fmt(r['final_loss'], '.4f'):>8} "
            f"{_fmt(r['moe_time_share'], '.2f'):>5} {_fmt(r['attention_time_share'], '.2f'):>5} "
            f"{_fmt(r['rest_time_share'], '.2f'):>5}"
        )
    lines.append("ratio: tokens/s over the TorchTitan run's; moe / attn / rest: shares of the step's wall time "
                 "(titan_mok.time_share; rest: embedding, dense FFN, norms, output head and loss, optimizer, host)")
    if report["no_baseline"]:
        lines.append(f"no same-dims TorchTitan model for {report['model']}: {report['no_baseline']}")
    for r in report["runs"]:
        lines.append(f"  {r['label']}: {r['metrics_jsonl'] or r['log']}")
    return "\n".join(lines)


def _plain(value):
    """NaN → None for JSON."""
    return None if isinstance(value, float) and math.isnan(value) else value


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(
        prog="python -m titan_mok.bench.e2e", description=__doc__.split("\n\n")[0],
        epilog="Any other --section.key value pair is a TOML override passed to every run.",
    )
    parser.add_argument("--model", required=True, choices=MODELS)
    parser.add_argument("--flavor", default="one_gpu", help="model flavor (default one_gpu)")
    parser.add_argument("--config", help="TOML (default train_configs/<model>/<flavor>.toml)")
    parser.add_argument("--steps", type=int, default=30, help="training steps per run (default 30)")
    parser.add_argument("--warmup", type=int, help="steps left out of the medians (default: a third of --steps)")
    parser.add_argument("--nproc", type=int, default=1, help="processes (GPUs) per run (default 1)")
    parser.add_argument("--ep", type=int, default=1, help="[parallelism] expert_parallel_degree (default 1)")
    parser.add_argument("--torchtitan-backend", action="store_true",
                        help='also run titan-mok\'s model with [mok] backend = "torchtitan"')
    parser.add_argument("--out", help="folder for the runs (default outputs/e2e/<model>-<flavor>-<time>; must not exist)")
    parser.add_argument("--timeout", type=float, help="seconds each run may take (default: no limit)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")
    args, overrides = parser.parse_known_args(argv)
    for i, item in enumerate(overrides):
        flag = item.startswith("--")
        if flag and "." not in item.split("=", 1)[0]:
            parser.error(f"unknown option {item!r}: overrides are --section.key (TOML keys)")
        if not flag and (i == 0 or not overrides[i - 1].startswith("--")):
            parser.error(f"unexpected argument {item!r}: overrides are --section.key [value]")
    if args.steps < 2:
        parser.error(f"--steps {args.steps}: need at least 2 (warm-up, then measured steps)")
    args.warmup = max(1, args.steps // 3) if args.warmup is None else args.warmup
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup {args.warmup} must be in [0, --steps = {args.steps})")
    for name in ("nproc", "ep"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)} must be >= 1")
    if args.nproc % args.ep:
        parser.error(f"--ep {args.ep} must divide --nproc {args.nproc}")
    args.config = args.config or f"train_configs/{args.model}/{args.flavor}.toml"
    if not Path(args.config).is_file():
        parser.error(f"--config {args.config}: no such file")
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    args.out = Path(args.out or f"outputs/e2e/{args.model}-{args.flavor}-{stamp}")
    if args.out.exists():
        parser.error(f"--out {args.out} exists; each invocation needs a fresh folder")
    return args, overrides


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    runs = plan_runs(args.model, args.torchtitan_backend)
    results = [launch(run, args, args.out / f"run{i}-{run.model_name}", overrides) for i, run in enumerate(runs)]
    baseline = next((r for r in results if r.model_name == BASELINE_MODEL and r.error is None), None)
    for r in results:
        if baseline is not None and r.error is None:
            r.ratio_to_torchtitan = r.tokens_per_s_per_gpu / baseline.tokens_per_s_per_gpu
    report = {
        "model": args.model, "flavor": args.flavor, "config": args.config, "overrides": overrides,
        "steps": args.steps, "warmup": args.warmup, "nproc": args.nproc, "ep": args.ep, "out": str(args.out),
        "device": next((r.device for r in results if r.device), None),
        "baseline": BASELINE_MODEL if args.model == MAPPED_MODEL else None,
        "no_baseline": NO_BASELINE.get(args.model),
        "runs": [{k: _plain(v) for k, v in asdict(r).items()} for r in results],
    }
    table = format_report(report)
    (args.out / "report.txt").write_text(table + "\n")
    (args.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1) if args.json else table, flush=True)
    for r in results:
        if r.error is not None:
            print(f"[e2e] {r.label}: {r.error}", file=sys.stderr)
    return 1 if any(r.error is not None for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
