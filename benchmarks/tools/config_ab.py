"""A/B of grouped-GEMM tile configs on a GPU: each kind of grouped_mm and each weight's gradient timed with the
committed tile table (tile_configs, this GPU's) and with a variant of it, in one process, bits compared.

    python3 -m benchmarks.tools.config_ab --precision bf16 --set 'bf16/plain@mid_rows={"HALF_TILES": false}'
    python3 -m benchmarks.tools.config_ab --precision mxfp8 --unset mxfp8/dual@few_rows --shapes kimi
    python3 -m benchmarks.tools.config_ab --precision bf16 \
        --set 'bf16/dual@mid_rows={"kernel": "warp_specialized", "BM": 128, "PERSISTENT": true, "STAGES": 3,
                                   "CONSUMER_REGS": 232}'
    python3 -m benchmarks.tools.config_ab --precision bf16 --set 'wgrad/flat={"BN": 64, "num_warps": 4}'

Entries: the table's grouped_mm entries "<precision>/<kind>@<tier>" (tiers few_rows, mid_rows, many_rows) and the
weight gradient's configs "wgrad/flat", "wgrad/rows", "wgrad/flat_ws", "wgrad/flat_ws_long", "wgrad/rows_ws".
``--set KEY=JSON`` merges a JSON object into the config CUDA runs for KEY (where that is the entry's Triton config,
both change: they stay one); a "kernel" field ("triton", "warp_specialized", "cooperative") puts another kernel's
config there, its fields given in full. ``--unset KEY`` runs the Triton kernel there (a grouped_mm entry's Triton
config; a "wgrad/*_ws*" config's loop on the Triton kernel). The GEMMs compared are those of the tables the variant
changes (both for a run without ``--set``/``--unset``): grouped_mm's four kinds, and each weight's gradient. Per
shape and case (the grouped_ffn benchmark's MoE-regime cases and 8 × 4096 rows), each GEMM's outputs under both
tables are compared with ``torch.equal`` and then both are timed in ``--rounds`` rounds of ``bench(fn, --rep-ms)``,
their order alternating; the median round is reported, with the fastest and slowest. One JSON line per (shape,
case, kind) goes to stdout and ``$OUT/config_ab.jsonl`` (or ``--out``); a case that does not fit the GPU's memory
gets a "skipped" line instead, the other cases still run, and the exit status is 1.
"""

import argparse
import dataclasses
import json
import os
import statistics
import sys

import torch

from benchmarks.tools.grouped_ffn import (SHAPES, TOKENS_PER_GPU, Case, bench, comma_choices, committed_table,
                                        gemms_by_kind, route_counts, use_growing_segments, wgrads_by_weight)
from titan_mok.kernels import tile_configs as tc

CASES = ("EP=1 balanced", "EP=1 skewed", "EP=2 balanced", "EP=2 skewed", "8x4096")
WGRAD = "wgrad/"  # the weight gradient's entries: "wgrad/" + a ChipTable.wgrad name
KERNELS = {"triton": (tc.TritonMM, tc.TritonWgrad), "warp_specialized": (tc.GluonMM, tc.GluonWgrad),
           "cooperative": (tc.CoopMM, None)}  # a "kernel" field's config classes (grouped_mm's, the weight gradient's)


def variant_table(committed: tc.ChipTable, sets: list[str], unsets: list[str]) -> tc.ChipTable:
    """committed with each "KEY=JSON" of sets merged in and each KEY of unsets on the Triton kernel (module
    docstring)."""
    mm, wgrad = dict(committed.mm), dict(committed.wgrad)
    for item in sets:
        key, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected KEY=JSON, e.g. 'bf16/plain@mid_rows={{\"HALF_TILES\": false}}'")
        _check_key(key, committed, "--set")
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--set {key}: {text!r} is not JSON ({e})") from None
        if not isinstance(fields, dict):
            raise ValueError(f"--set {key}: the value must be a JSON object, got {text!r} (--unset KEY: the Triton "
                             "kernel there)")
        if key.startswith(WGRAD):
            name = key.removeprefix(WGRAD)
            wgrad[name] = _merged(key, wgrad[name], dict(fields, **({"loop": name.split("_")[0]}
                                                                     if "kernel" in fields else {})), 1)
        else:
            entry = mm[key]
            cuda = _merged(key, entry.cuda, fields, 0)
            mm[key] = tc.MMEntry(cuda if entry.cuda is entry.triton and isinstance(cuda, tc.TritonMM)
                                 else entry.triton, cuda)
    for key in unsets:
        _check_key(key, committed, "--unset")
        if key in (WGRAD + "flat", WGRAD + "rows"):
            raise ValueError(f"--unset {key}: it runs the Triton kernel already; --set it instead")
        if key.startswith(WGRAD):
            name = key.removeprefix(WGRAD)
            wgrad[name] = wgrad[name.split("_")[0]]
        else:
            mm[key] = tc.MMEntry(mm[key].triton, mm[key].triton)
    try:
        return dataclasses.replace(committed, mm=mm, wgrad=wgrad)
    except ValueError as e:
        raise ValueError(f"the variant table: {e}") from None


def _merged(key: str, cfg, fields: dict, which: int):
    """cfg with fields merged in; with a "kernel" field, that kernel's config class (0: grouped_mm's, 1: the weight
    gradient's) from fields alone."""
    fields = dict(fields)
    kernel = fields.pop("kernel", None)
    if kernel is not None and (kernel not in KERNELS or KERNELS[kernel][which] is None):
        allowed = [k for k, classes in KERNELS.items() if classes[which] is not None]
        raise ValueError(f"--set {key}: kernel must be one of {allowed}, got {kernel!r}")
    try:
        return KERNELS[kernel][which](**fields) if kernel else dataclasses.replace(cfg, **fields)
    except TypeError as e:  # an unknown or missing field
        raise ValueError(f"--set {key}: {e}; the fields of {type(cfg).__name__ if not kernel else kernel}: "
                         f"{[f.name for f in dataclasses.fields(KERNELS[kernel][which] if kernel else cfg)]}") from None


def _check_key(key: str, committed: tc.ChipTable, flag: str):
    keys = [*committed.mm, *(WGRAD + name for name in committed.wgrad)]
    if key not in keys:
        raise ValueError(f"{flag} {key}: not a config key (a grouped_mm entry '<precision>/<kind>@<tier>' or a "
                         f"weight-gradient config 'wgrad/<name>'); keys: {', '.join(keys)}")


def case_counts(shape: str, case: str) -> torch.Tensor:
    """Rows per expert of a grouped_ffn benchmark case."""
    _, _, num_experts, top_k = SHAPES[shape]
    if case == "8x4096":
        return torch.full((8,), 4096, dtype=torch.int64)
    ep, routing = case.split()
    return route_counts(TOKENS_PER_GPU * top_k, num_experts // int(ep.removeprefix("EP=")), routing == "skewed")


def _outputs(fn, keep: bool = True) -> list[torch.Tensor]:
    """fn's output tensors; keep: cloned, to be held while other code runs (the compared side is not: at Kimi EP=1
    a weight gradient is 11 GB)."""
    out = fn()
    out = [out] if torch.is_tensor(out) else list(out)
    return [t.clone() for t in out] if keep else out


def compare(fn, tables: dict[str, tc.ChipTable], rounds: int, rep_ms: float, bench) -> dict:
    """Bits of fn(tables["variant"]) against fn(tables["committed"]), then the median times (each round
    ``bench(lambda: fn(table), rep_ms)``) and each table's [fastest, slowest] round."""
    ref = _outputs(lambda: fn(tables["committed"]))
    bits_equal = all(torch.equal(a, b) for a, b in zip(ref, _outputs(lambda: fn(tables["variant"]), keep=False)))
    del ref
    times = timed_rounds({name: (lambda table=table: fn(table)) for name, table in tables.items()}, rounds, rep_ms,
                         bench)
    return {"bits_equal": bits_equal, **times}


def timed_rounds(fns: dict, rounds: int, rep_ms: float, bench) -> dict:
    """Each of fns timed in ``rounds`` rounds of ``bench(fn, rep_ms)``, their order alternating between rounds so
    that clock and thermal drift meet all alike: "<name>_ms" the median round, "<name>_range_ms" [fastest,
    slowest]."""
    times = {name: [] for name in fns}
    for r in range(rounds):
        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            times[name].append(bench(fns[name], rep_ms))
    # the fastest and slowest round beside the median: the same code's rounds spread by up to ~10% on the
    # H200, which bounds the differences a run can show
    return {**{f"{name}_ms": round(statistics.median(t), 4) for name, t in times.items()},
            **{f"{name}_range_ms": [round(min(t), 4), round(max(t), 4)] for name, t in times.items()}}


def gemms_to_compare(c, args) -> dict:
    """The GEMMs of case c (callables of the tile table) whose part of the table the variant changes (both parts'
    for an A/A run)."""
    changed = _changed_keys(args)
    mm = not changed or any(not k.startswith(WGRAD) for k in changed)
    wgrad = not changed or any(k.startswith(WGRAD) for k in changed)
    return {**(gemms_by_kind(c, args.precision) if mm else {}),
            **(wgrads_by_weight(c, args.precision) if wgrad else {})}


def _changed_keys(args) -> list[str]:
    return [item.partition("=")[0] for item in args.sets] + args.unsets


def add_ab_args(p: argparse.ArgumentParser, rounds: int, rep_ms: float):
    """The flags of the GEMM A/B tools (this one and kernel_ab): precision, shapes, cases, rounds, output folder."""
    p.add_argument("--precision", choices=["bf16", "mxfp8"], required=True)
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--rep-ms", type=float, default=rep_ms)
    p.add_argument("--out", default=os.environ.get("OUT", "."))


def add_variant_args(p: argparse.ArgumentParser):
    """The flags that make a variant table (variant_table): --set KEY=JSON and --unset KEY, repeatable; this
    tool's, and sass's to compile the variant offline."""
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=JSON",
                   help="merge a JSON object into the config CUDA runs for an entry (\"kernel\": another kernel's)")
    p.add_argument("--unset", dest="unsets", action="append", default=[], metavar="KEY",
                   help="the Triton kernel for an entry")


def ab_shapes_and_cases(p: argparse.ArgumentParser, args) -> tuple[list[str], list[str]]:
    """add_ab_args' flags checked: (shapes, cases)."""
    return comma_choices(p, "--shapes", args.shapes, SHAPES), comma_choices(p, "--cases", args.cases, CASES)


def main():
    use_growing_segments()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_ab_args(p, rounds=3, rep_ms=25)
    add_variant_args(p)
    args = p.parse_args()
    shapes, cases = ab_shapes_and_cases(p, args)
    committed = committed_table()
    try:
        tables = {"committed": committed, "variant": variant_table(committed, args.sets, args.unsets)}
    except ValueError as e:
        p.error(str(e))
    os.makedirs(args.out, exist_ok=True)
    # line-buffered: a run cut short by a time limit keeps the lines it measured
    with open(os.path.join(args.out, "config_ab.jsonl"), "a", buffering=1) as log:
        log.write(json.dumps({"sets": args.sets, "unsets": args.unsets, "precision": args.precision}) + "\n")
        skipped = run_cases(shapes, cases, lambda shape, case: ab_case(shape, case, args, tables, log), log)
    if skipped:
        sys.exit(f"config_ab: {skipped} case(s) did not fit the GPU's memory (their \"skipped\" lines)")


def run_cases(shapes: list[str], cases: list[str], run_case, log) -> int:
    """run_case(shape, case) for each shape and case. One that runs out of GPU memory (the largest EP=1 cases on an
    80 GB H100) gets a JSON line {"shape", "case", "skipped"} and the others still run; returns how many did."""
    skipped = 0
    for shape in shapes:
        for case in cases:
            try:
                run_case(shape, case)
            except torch.OutOfMemoryError as e:
                rec = {"shape": shape, "case": case, "skipped": ". ".join(str(e).split(". ")[:2])}  # what it asked for
                print(json.dumps(rec), flush=True)
                log.write(json.dumps(rec) + "\n")
                skipped += 1
            torch.cuda.empty_cache()  # the case's tensors went with run_case's frame (and the error's traceback)
    return skipped


def ab_case(shape: str, case: str, args, tables: dict, log):
    """One case's GEMMs compared and timed, a JSON line each. A function of its own so that nothing holds the
    case's tensors (tens of GB at EP=1) once it returns: a loop variable left bound to its last GEMM did, and the
    next case ran out of memory on an 80 GB H100."""
    dim_h, dim_i, _, _ = SHAPES[shape]
    c = Case(dim_h, dim_i, case_counts(shape, case))
    for key, fn in gemms_to_compare(c, args).items():
        rec = {"shape": shape, "case": case, "kind": key, **compare(fn, tables, args.rounds, args.rep_ms, bench)}
        print(json.dumps(rec), flush=True)
        log.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
