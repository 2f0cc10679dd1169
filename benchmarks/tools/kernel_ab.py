"""A/B of the grouped-GEMM kernels' code on a GPU: each kind of grouped_mm and each weight's gradient run by the
working tree's kernels and by a baseline's (an earlier revision's ``kernels/`` folder), in one process, bits
compared.

    mkdir -p _scratch/base && git archive 0ba1787 kernels | tar -x -C _scratch/base
    python3 -m benchmarks.tools.kernel_ab --baseline _scratch/base/kernels --precision bf16 --gemms wgrad

(The GPU machine has no git: make the baseline folder here and pass it with the device tool's carry. The
baseline's grouped_gemm, grouped_ffn and tile_configs functions are called as the working tree's are: a revision
whose signatures differ, one from before tile_configs among them, cannot be compared this way.)

The baseline's ``.py`` files are copied into a temporary package, ``titan_mok_baseline_kernels``, with their imports
of ``titan_mok.kernels`` pointed at it, and imported beside the working tree's (Triton reads a kernel's source from
its file, so the copies are real files): each side runs its own kernels/ modules, the MXFP8 format and the tile
tables included (kernels/ imports nothing else of titan_mok). Each side makes its own operands (the weights in the
layouts its kernels read), from the same case, one GEMM's at a time: in MXFP8 both sides' copies of the weights that
GEMM reads are held at once (Kimi K2.7 at EP=1: 34 GB of bf16 weights and 2 x 11 GB of MXFP8 gate and up; bf16
operands are views). Per shape and case (the grouped_ffn benchmark's MoE-regime cases and 8 × 4096 rows), each
GEMM's outputs are compared with ``torch.equal``, then both sides are timed in ``--rounds`` rounds of ``bench(fn,
--rep-ms)``, their order alternating; the median round is reported, with the fastest and slowest, and
"working/baseline", the ratio of the medians. ``--gemms`` picks grouped_mm's four kinds ("mm"), the three weight
gradients ("wgrad") or both. One JSON line per (shape, case, GEMM) goes to stdout and ``$OUT/kernel_ab.jsonl`` (or
``--out``); a case that does not fit the GPU's memory gets a "skipped" line instead (config_ab.run_cases), the other
cases still run, and the exit status is 1.
"""

import argparse
import contextlib
import importlib
import json
import os
import sys
import tempfile

import torch

from benchmarks.tools import grouped_ffn
from benchmarks.tools.config_ab import (_outputs, ab_shapes_and_cases, add_ab_args, case_counts, run_cases,
                                      timed_rounds)
from benchmarks.tools.grouped_ffn import OUR_KERNELS, SHAPES, Case, bench, use_growing_segments, wgrads_by_weight

BASELINE_PACKAGE = "titan_mok_baseline_kernels"


def check_baseline(folder: str):
    """A clear error for a --baseline that is not a kernels/ folder this tool can call."""
    missing = [f for f in ("__init__.py", "grouped_gemm.py", "grouped_ffn.py", "tile_configs.py")
               if not os.path.isfile(os.path.join(folder, f))]
    if missing:
        raise ValueError(f"--baseline {folder!r}: not a kernels/ folder with tile_configs (no {', '.join(missing)}); "
                         f"give an earlier revision's, e.g. from `git archive REV kernels | tar -x -C DIR`: DIR/kernels")


@contextlib.contextmanager
def baseline_kernels(folder: str):
    """(grouped_gemm, grouped_ffn, tile_configs) of the kernels in folder, imported as the package BASELINE_PACKAGE
    in a temporary folder for the duration (Triton reads the kernels' source files), then forgotten."""
    check_baseline(folder)
    with tempfile.TemporaryDirectory() as workdir:
        package = os.path.join(workdir, BASELINE_PACKAGE)
        os.makedirs(package)
        for name in sorted(os.listdir(folder)):
            if name.endswith(".py"):
                with open(os.path.join(folder, name)) as f:
                    source = f.read().replace("titan_mok.kernels", BASELINE_PACKAGE)
                with open(os.path.join(package, name), "w") as f:
                    f.write(source)
        sys.path.insert(0, workdir)
        importlib.invalidate_caches()
        try:
            yield tuple(importlib.import_module(f"{BASELINE_PACKAGE}.{name}")
                        for name in ("grouped_gemm", "grouped_ffn", "tile_configs"))
        finally:
            sys.path.remove(workdir)
            for name in [m for m in sys.modules if m == BASELINE_PACKAGE or m.startswith(BASELINE_PACKAGE + ".")]:
                del sys.modules[name]


def gemm_makers(c, args, kernels) -> dict:
    """The GEMMs of case c that ``--gemms`` picks, made by kernels (the working tree's or the baseline's): per GEMM a
    function that makes its operands and returns it, so that each side holds one GEMM's weights at a time."""
    out = {}
    if args.gemms in ("mm", "all"):
        out.update(grouped_ffn.gemm_makers(c, args.precision, kernels))
    if args.gemms in ("wgrad", "all"):  # their operands are activations: made already
        out.update({key: (lambda fn=fn: fn) for key, fn in wgrads_by_weight(c, args.precision, kernels).items()})
    return out


def compare(working_fn, baseline_fn, rounds: int, rep_ms: float, bench) -> dict:
    """Bits of the two sides' outputs, then their times (config_ab.timed_rounds) and the ratio of the medians."""
    ref = _outputs(baseline_fn)
    bits_equal = all(torch.equal(a, b) for a, b in zip(ref, _outputs(working_fn, keep=False)))
    del ref
    times = timed_rounds({"working": working_fn, "baseline": baseline_fn}, rounds, rep_ms, bench)
    return {"bits_equal": bits_equal, **times,
            "working/baseline": round(times["working_ms"] / times["baseline_ms"], 4)}


def main():
    use_growing_segments()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="an earlier revision's kernels/ folder")
    add_ab_args(p, rounds=5, rep_ms=20)
    p.add_argument("--gemms", choices=["mm", "wgrad", "all"], default="all")
    args = p.parse_args()
    shapes, cases = ab_shapes_and_cases(p, args)
    try:
        check_baseline(args.baseline)
    except ValueError as e:
        p.error(str(e))
    os.makedirs(args.out, exist_ok=True)
    # line-buffered: a run cut short by a time limit keeps the lines it measured
    with baseline_kernels(args.baseline) as kernels, open(os.path.join(args.out, "kernel_ab.jsonl"), "a",
                                                           buffering=1) as log:
        log.write(json.dumps({"baseline": os.path.abspath(args.baseline), "precision": args.precision,
                              "gemms": args.gemms}) + "\n")
        skipped = run_cases(shapes, cases, lambda shape, case: ab_case(shape, case, args, kernels, log), log)
    if skipped:
        sys.exit(f"kernel_ab: {skipped} case(s) did not fit the GPU's memory (their \"skipped\" lines)")


def ab_case(shape: str, case: str, args, kernels, log):
    """One case's GEMMs on both sides compared and timed, a JSON line each; nothing holds the case's tensors once it
    returns (as config_ab.ab_case)."""
    dim_h, dim_i, _, _ = SHAPES[shape]
    c = Case(dim_h, dim_i, case_counts(shape, case))
    ours, theirs = gemm_makers(c, args, OUR_KERNELS), gemm_makers(c, args, kernels)
    # the same GEMMs in the same order; a weight gradient's key names its loop on that side
    if len(ours) != len(theirs):
        raise ValueError(f"the baseline's GEMMs {list(theirs)} do not pair with the working tree's {list(ours)}")
    for (key, make), (base_key, base_make) in zip(ours.items(), theirs.items()):
        # each GEMM (and its weights) made here and dropped when compare returns
        rec = {"shape": shape, "case": case, "kind": key, "baseline_kind": base_key,
               **compare(make(), base_make(), args.rounds, args.rep_ms, bench)}
        print(json.dumps(rec), flush=True)
        log.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
