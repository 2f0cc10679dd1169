"""Line up two or more training runs.

    python -m titan_mok.compare RUN [RUN ...] [--metric NAME ...] [--plot out.png] [--json]

RUN is one of
- a local W&B run directory (``.../wandb/offline-run-*``, holding ``run-*.wandb``),
  its ``.wandb`` file, or a ``wandb`` folder holding one run, read with W&B's own
  reader (``wandb leet inspect --json``);
- a JSONL written by ``titan_mok.metrics`` (``metrics.jsonl``), or the run's log
  folder holding it;
- ``entity/project/run_id``: a W&B run fetched through the W&B API (needs credentials).

Prints, for each selected metric (default: loss, tps, mfu; ``--metric`` takes an
alias or any logged key), its final, mean and best value per run over the steps
all runs logged, each as a ratio to the first run; whether each run's loss curve
(and any ``--metric`` curve) is bitwise identical to the first run's and, if not,
the first step where it differs and by how much; and the config keys whose
values differ. ``--plot`` writes a PNG, one panel per selected metric against
the step, one line per run; ``--json`` prints the same data as JSON instead.
Bad input (a missing or unreadable run, no common steps, an unknown metric)
ends with a one-line message and exit status 2.
"""

import argparse
import json
import math
import os
import re
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ALIASES = {
    "loss": "loss_metrics/global_avg_loss",
    "tps": "throughput(tps)",
    "tflops": "tflops",
    "mfu": "mfu(%)",
    "grad_norm": "grad_norm",
}
"""Short names of TorchTitan's series (tps and tflops are per GPU)."""
DEFAULT_METRICS = ("loss", "tps", "mfu")
HIGHER_IS_BETTER = frozenset({"throughput(tps)", "tflops", "mfu(%)"})
"""Series whose best value is the maximum; the minimum for every other series."""
PANEL_INCHES, PLOT_DPI = (5, 4), 100
"""Each plot panel is 500 × 400 pixels."""


class CompareError(Exception):
    """Bad input; the message says which run or metric and why."""


@dataclass
class Run:
    source: str
    name: str
    series: dict[str, dict[int, float]]
    """metric → step → value (numeric values only)."""
    config: dict[str, Any]


def _as_float(value) -> float | None:
    """JSON number, or W&B's spelling of a non-finite one ("NaN", "Infinity"); None otherwise."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.lstrip("+-").lower() in ("nan", "inf", "infinity"):
        return float(value)
    return None


def _add_step(series: dict[str, dict[int, float]], step: int, metrics: dict[str, Any]) -> None:
    for key, value in metrics.items():
        number = _as_float(value)
        if not key.startswith("_") and number is not None:
            series.setdefault(key, {})[step] = number


def read_jsonl(path: Path) -> Run:
    """A ``metrics.jsonl`` of titan_mok.metrics: header line, then one line per step."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise CompareError(f"{path}: cannot read it ({e})") from None
    series: dict[str, dict[int, float]] = {}
    header = None
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise CompareError(f"{path}:{number}: not a JSON line ({e.msg})") from None
        if number == 1:
            if not (isinstance(record, dict) and isinstance(record.get("config"), dict)):
                raise CompareError(f"{path}:1: expected the header {{\"config\": ..., \"run\": ...}} of titan_mok.metrics")
            header = record
        elif isinstance(record, dict) and isinstance(record.get("step"), int) and isinstance(record.get("metrics"), dict):
            _add_step(series, record["step"], record["metrics"])
        else:
            raise CompareError(f"{path}:{number}: expected {{\"step\": N, \"metrics\": {{...}}}}")
    if header is None:
        raise CompareError(f"{path}: empty file")
    return Run(str(path), str(header.get("run", {}).get("name") or path.parent.name), series, header["config"])


def read_wandb_file(path: Path) -> Run:
    """A local ``run-*.wandb`` transaction log, through ``wandb leet inspect --json``."""
    cmd = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise CompareError(f"{path}: W&B's reader did not run ({e})") from None
    if proc.returncode != 0:
        raise CompareError(f"{path}: W&B's reader failed: {(proc.stderr or proc.stdout).strip()[-500:]}")
    series: dict[str, dict[int, float]] = {}
    config: dict[str, Any] = {}
    name = path.parent.name
    for line in proc.stdout.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise CompareError(f"{path}: W&B's reader printed a line that is not JSON: {line[:200]!r}") from None
        kind = record.get("type")
        if kind == "run":
            name = record["run"].get("display_name") or name
            config.update(record["run"].get("config", {}).get("update", {}))
        elif kind == "config":
            config.update(record["config"].get("update", {}))
        elif kind == "history":
            item = record["history"].get("item", {})
            step = record["history"].get("step", {}).get("num", item.get("_step"))
            if step is not None:
                _add_step(series, int(step), item)
    config.pop("_wandb", None)
    return Run(str(path), str(name), series, config)


def read_wandb_api(path: str) -> Run:
    """``entity/project/run_id`` through the W&B API."""
    try:
        import wandb

        run = wandb.Api().run(path)
        series: dict[str, dict[int, float]] = {}
        for row in run.scan_history():
            if row.get("_step") is not None:
                _add_step(series, int(row["_step"]), row)
        return Run(path, str(run.name), series, dict(run.config))
    except Exception as e:  # W&B raises many types (no credentials, no network, no such run)
        raise CompareError(
            f"{path}: not a local file or directory, and fetching it as a W&B run (entity/project/run_id) "
            f"failed: {type(e).__name__}: {e}"
        ) from None


def load_run(arg: str) -> Run:
    path = Path(arg)
    if path.is_file():
        return read_wandb_file(path) if path.suffix == ".wandb" else read_jsonl(path)
    if path.is_dir():
        logs = sorted(path.glob("run-*.wandb"))
        if len(logs) == 1:
            return read_wandb_file(logs[0])
        if (path / "metrics.jsonl").is_file():
            return read_jsonl(path / "metrics.jsonl")
        nested = sorted(path.glob("*run-*/run-*.wandb")) + sorted(path.glob("wandb/*run-*/run-*.wandb"))
        if len(logs) + len(nested) == 1:
            return read_wandb_file(nested[0])
        if logs or nested:
            found = ", ".join(str(p) for p in logs + nested)
            raise CompareError(f"{arg}: holds several W&B runs ({found}); name one")
        raise CompareError(f"{arg}: neither a W&B run directory (run-*.wandb) nor a folder with metrics.jsonl")
    if re.fullmatch(r"[^/\s]+/[^/\s]+/[^/\s]+", arg):
        return read_wandb_api(arg)
    raise CompareError(f"{arg}: no such file or directory (nor entity/project/run_id)")


def resolve_metric(name: str, runs: list[Run]) -> str:
    key = ALIASES.get(name, name)
    for i, run in enumerate(runs):
        if key not in run.series:
            known = ", ".join(sorted(run.series)) or "none"
            raise CompareError(f"unknown metric {name!r}: run #{i} ({run.source}) did not log {key!r}; it logged: {known}")
    return key


def common_steps(key: str, runs: list[Run]) -> list[int]:
    steps = set.intersection(*(set(run.series[key]) for run in runs))
    if not steps:
        spans = "; ".join(f"#{i}: {_span(run.series[key])}" for i, run in enumerate(runs))
        raise CompareError(f"the runs have no common steps for {key!r} ({spans})")
    return sorted(steps)


def _span(steps) -> str:
    return f"steps {min(steps)}–{max(steps)} ({len(steps)})" if steps else "no steps"


def _ratio(value: float, first: float) -> float | None:
    return value / first if math.isfinite(value) and math.isfinite(first) and first != 0 else None


def summarize(key: str, runs: list[Run], steps: list[int]) -> list[dict[str, Any]]:
    """final/mean/best over the common steps, and each as a ratio to run #0."""
    rows = []
    for run in runs:
        values = [run.series[key][s] for s in steps]
        finite = [v for v in values if math.isfinite(v)]
        best = (max if key in HIGHER_IS_BETTER else min)(finite) if finite else math.nan
        rows.append({"final": values[-1], "mean": math.fsum(values) / len(values), "best": best})
    for row in rows:
        for stat in ("final", "mean", "best"):
            row[f"{stat}_ratio"] = _ratio(row[stat], rows[0][stat])
    return rows


def _bits(value: float) -> bytes:
    return struct.pack("<d", value)


def curve_diff(key: str, runs: list[Run], steps: list[int]) -> list[dict[str, Any]]:
    """Each run after the first against run #0, bit for bit over the common steps."""
    first = runs[0].series[key]
    results = []
    for i, run in enumerate(runs[1:], 1):
        other = run.series[key]
        diverged = [s for s in steps if _bits(first[s]) != _bits(other[s])]
        result = {"run": i, "identical": not diverged, "steps_compared": len(steps)}
        if diverged:
            step = diverged[0]
            a, b = first[step], other[step]
            result.update(
                first_divergent_step=step,
                values=[a, b],
                abs_diff=abs(b - a),
                rel_diff=abs(b - a) / abs(a) if a else None,
                max_abs_diff=max(abs(other[s] - first[s]) for s in diverged),
            )
        results.append(result)
    return results


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


_MISSING = "<missing>"


def _canonical(value) -> str:
    """Numbers compare by value (W&B's reader prints 1.0 as 1)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(float(value))
    if isinstance(value, list):
        return "[" + ",".join(_canonical(v) for v in value) + "]"
    return json.dumps(value, sort_keys=True)


def config_diff(runs: list[Run]) -> dict[str, list[Any]]:
    flats = [_flatten(run.config) for run in runs]
    keys = sorted(set().union(*flats))
    diff = {}
    for key in keys:
        values = [flat.get(key, _MISSING) for flat in flats]
        if len({_canonical(v) for v in values}) > 1:
            diff[key] = values
    return diff


def compare(runs: list[Run], metric_names: list[str]) -> dict[str, Any]:
    selected = metric_names or list(DEFAULT_METRICS)
    keys = list(dict.fromkeys(resolve_metric(name, runs) for name in selected))
    curve_keys = list(dict.fromkeys([resolve_metric("loss", runs)] + [resolve_metric(n, runs) for n in metric_names]))
    metrics, curves = {}, {}
    for key in dict.fromkeys(keys + curve_keys):
        steps = common_steps(key, runs)
        if key in keys:
            metrics[key] = {"common_steps": len(steps), "per_run": summarize(key, runs, steps)}
        if key in curve_keys:
            curves[key] = curve_diff(key, runs, steps)
    return {
        "runs": [
            {"index": i, "name": run.name, "source": run.source, "steps": {k: len(run.series[k]) for k in keys}}
            for i, run in enumerate(runs)
        ],
        "metrics": metrics,
        "curves": curves,
        "config_diff": config_diff(runs),
    }


def plot(runs: list[Run], keys: list[str], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(
        1, len(keys), figsize=(PANEL_INCHES[0] * len(keys), PANEL_INCHES[1]), dpi=PLOT_DPI, squeeze=False
    )
    for ax, key in zip(axes[0], keys):
        for i, run in enumerate(runs):
            steps = sorted(run.series[key])
            ax.plot(steps, [run.series[key][s] for s in steps], marker=".", label=f"#{i} {run.name}")
        if not any(math.isfinite(v) for run in runs for v in run.series[key].values()):
            ax.text(0.5, 0.5, "no finite values", transform=ax.transAxes, ha="center")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step")
        ax.set_title(key)
        ax.legend(fontsize="small")
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=PLOT_DPI)
    except OSError as e:
        raise CompareError(f"--plot {out}: cannot write it ({e})") from None
    finally:
        plt.close(fig)


def _fmt(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.6g}"
    return json.dumps(value)


def _ratio_text(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"×{ratio:.4f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[c]) for r in [header] + rows) for c in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in [header] + rows)


def render(report: dict[str, Any]) -> str:
    runs = report["runs"]
    out = ["runs:"] + [f"  #{r['index']} {r['name']}  ({r['source']})" for r in runs]
    for key, data in report["metrics"].items():
        out.append(f"\n{key} over {data['common_steps']} common steps (ratio to #0 in parentheses)")
        rows = [
            [f"#{i} {runs[i]['name']}"]
            + [f"{_fmt(row[stat])} ({_ratio_text(row[stat + '_ratio'])})" for stat in ("final", "mean", "best")]
            for i, row in enumerate(data["per_run"])
        ]
        out.append(_table(["run", "final", "mean", "best"], rows))
    out.append("\ncurves against #0:")
    for key, results in report["curves"].items():
        for r in results:
            if r["identical"]:
                out.append(f"  {key}: #{r['run']} bitwise identical over {r['steps_compared']} common steps")
            else:
                a, b = r["values"]
                out.append(
                    f"  {key}: #{r['run']} diverges at step {r['first_divergent_step']}: {a!r} vs {b!r} "
                    f"(|Δ| {_fmt(r['abs_diff'])}, relative {_fmt(r['rel_diff'])}; max |Δ| {_fmt(r['max_abs_diff'])})"
                )
    diff = report["config_diff"]
    out.append(f"\nconfig differences ({len(diff)} keys):" if diff else "\nconfig: identical")
    if diff:
        out.append(_table(["key"] + [f"#{r['index']}" for r in runs], [[k] + [_fmt(v) for v in vs] for k, vs in diff.items()]))
    if report.get("plot"):
        out.append(f"\nplot: {report['plot']}")
    return "\n".join(out)


def _json_safe(value):
    """NaN/Infinity → null, so --json prints standard JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m titan_mok.compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN", help="W&B run dir or .wandb file, metrics.jsonl, or entity/project/run_id")
    parser.add_argument("--metric", action="append", default=[], metavar="NAME",
                        help=f"a logged key or an alias ({', '.join(ALIASES)}); repeatable; default: {', '.join(DEFAULT_METRICS)}")
    parser.add_argument("--plot", type=Path, metavar="OUT.png", help="write a PNG: one panel per metric vs step")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    try:
        runs = [load_run(arg) for arg in args.runs]
        report = compare(runs, args.metric)
        if args.plot:
            plot(runs, list(report["metrics"]), args.plot)
            report["plot"] = str(args.plot)
    except CompareError as e:
        print(f"titan_mok.compare: {e}", file=sys.stderr)
        return 2
    try:
        print(json.dumps(_json_safe(report), indent=2, allow_nan=False) if args.json else render(report), flush=True)
    except BrokenPipeError:  # the reader stopped early (`| head`); nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
