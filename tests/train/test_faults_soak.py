"""A long EP=2 `titan_mok.train` run of the Kimi debug flavor, checkpointing every quarter
(docs/faults.md): after warm-up each rank's resident memory grows by less than 5%, its open
files and threads do not grow, and the step time stays steady. The test samples /proc every
0.5 s. ``MOK_SOAK_STEPS`` sets the steps (CI: 200; the recorded run: 2000);
``MOK_SOAK_REPORT``, when set, is a path the figures are written to (JSON).

Warm-up: the first checkpoint interval and a tenth of the run more. Resident memory rises
over the first saves (the allocator keeps what a save allocated; recorded run: +10% by step
800 of 2000, each save a step up) and then levels off: the first save is inside the warm-up."""

import json
import os
import statistics
import time
from pathlib import Path

import pytest

from tests.train.fault_jobs import Job

STEPS = int(os.environ.get("MOK_SOAK_STEPS", "200"))
RSS_GROWTH = 0.05
STEP_TIME_RATIO = 1.5
"""Most the late median step time may exceed the early one by (a shared CPU's noise)."""
pytestmark = [pytest.mark.soak, pytest.mark.serial]


def _status(pid: int) -> dict[str, int] | None:
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        return {"rss_kib": int(fields["VmRSS"].split()[0]), "threads": int(fields["Threads"]),
                "fds": len(os.listdir(f"/proc/{pid}/fd"))}
    except (OSError, KeyError, ValueError):
        return None


def _window(samples: list[dict], rank: int, lo: int, hi: int, key: str) -> list[int]:
    return [s[rank][key] for s in samples if lo <= s["step"] <= hi and rank in s]


def test_long_run_does_not_leak(tmp_path):
    assert STEPS >= 100, "MOK_SOAK_STEPS must be >= 100 (warm-up, then windows of a tenth of the run)"
    folder = tmp_path / "run"
    job = Job(tmp_path / "log", "--training.steps", str(STEPS), "--metrics.log_freq", "10", "--job.dump_folder",
              str(folder), "--checkpoint.enable", "--checkpoint.interval", str(STEPS // 4), "--checkpoint.keep_latest_k", "2")
    samples, started = [], time.monotonic()
    try:
        job.wait_until(lambda: len(job.workers()) == 2, 120, "both workers")
        workers = job.workers()
        while job.proc.poll() is None:
            sample = {"step": job.steps_logged(), "t": time.monotonic() - started}
            for rank, pid in workers.items():
                if (status := _status(pid)) is not None:
                    sample[rank] = status
            samples.append(sample)
            time.sleep(0.5)
    finally:
        rc = job.wait(STEPS * 5)
    assert rc == 0, job.output()[-4000:]

    tenth = STEPS // 10
    warm = STEPS // 4 + tenth  # the first save (at STEPS // 4) and a tenth more
    late = (STEPS - tenth, STEPS - 1)  # the last step's save and exit are not training
    figures = {"steps": STEPS, "wall_s": round(time.monotonic() - started, 1), "warm_up_steps": warm, "ranks": {}}
    for rank in (0, 1):
        rss_early = statistics.median(_window(samples, rank, warm, warm + tenth, "rss_kib"))
        rss_late = statistics.median(_window(samples, rank, *late, "rss_kib"))
        figures["ranks"][rank] = {
            "rss_mib_after_warm_up": round(rss_early / 1024, 1), "rss_mib_late": round(rss_late / 1024, 1),
            "rss_growth": round(rss_late / rss_early - 1, 4),
            "fds_after_warm_up": max(_window(samples, rank, warm, warm + tenth, "fds")),
            "fds_late": max(_window(samples, rank, *late, "fds")),
            "threads_after_warm_up": max(_window(samples, rank, warm, warm + tenth, "threads")),
            "threads_late": max(_window(samples, rank, *late, "threads")),
        }
    (jsonl,) = folder.glob("tb/*/metrics.jsonl")
    step_s = {r["step"]: r["metrics"]["time_metrics/end_to_end(s)"]
              for r in map(json.loads, jsonl.read_text().splitlines()[1:])}
    early_s = statistics.median(v for s, v in step_s.items() if warm < s <= STEPS // 2)
    late_s = statistics.median(v for s, v in step_s.items() if s > STEPS - STEPS // 4)
    figures.update(step_s_after_warm_up=round(early_s, 4), step_s_late=round(late_s, 4))
    print("\nsoak:", json.dumps(figures))
    if os.environ.get("MOK_SOAK_REPORT"):
        Path(os.environ["MOK_SOAK_REPORT"]).write_text(json.dumps({**figures, "samples": samples}, indent=1))

    for rank, f in figures["ranks"].items():
        assert f["rss_growth"] < RSS_GROWTH, f"rank {rank}: resident memory grew {f['rss_growth']:.1%} after warm-up"
        assert f["fds_late"] <= f["fds_after_warm_up"], f"rank {rank}: open files grew: {f}"
        assert f["threads_late"] <= f["threads_after_warm_up"], f"rank {rank}: threads grew: {f}"
    assert late_s <= STEP_TIME_RATIO * early_s, f"step time went from {early_s:.3f} s to {late_s:.3f} s"
