"""A/B of grouped-GEMM tile configs on a GPU: each kind of grouped_mm timed with the committed
``_MM_CONFIGS`` and with a variant of them, in one process, bits compared.

    python3 -m titan_mok.bench.config_ab --precision bf16 --set 'bf16/plain={"HALF_TILES": false}'
    python3 -m titan_mok.bench.config_ab --precision mxfp8 --unset mxfp8_ws/dual@few_rows --shapes kimi

    python3 -m titan_mok.bench.config_ab --precision bf16 --set 'wgrad/flat={"BN": 64, "num_warps": 4}'

Entries: ``_MM_CONFIGS``' keys (grouped_mm's kinds) and the weight gradient's as "wgrad/flat",
"wgrad/rows" (its loops), "wgrad/flat_ws", "wgrad/flat_ws_long" and "wgrad/rows_ws" (``_WGRAD_CONFIGS``). ``--set
KEY=JSON`` merges a JSON object into the committed entry KEY (a new "@few_rows" or "@many_rows" key, or a None entry,
starts empty) or, with ``null``, makes a grouped_mm entry or a "wgrad/*_ws*" one None (a None "<precision>_ws/<kind>"
runs the Triton kernel, but in a rows tier with its own "@<tier>" entry; a None "wgrad/flat_ws" the Triton kernel's
flat loop, a None "wgrad/flat_ws_long" the "flat_ws" config, a None "wgrad/rows_ws" the Triton kernel's row loop);
``--unset KEY`` removes a grouped_mm entry. The GEMMs compared are those of the tables the variant
changes (both for a run without ``--set``/``--unset``): grouped_mm's four kinds, and each weight's
gradient. Per shape and case (the
grouped_ffn benchmark's MoE-regime cases and 8 × 4096 rows), each GEMM's outputs under both configs
are compared with ``torch.equal`` and then both are timed in ``--rounds`` rounds of
``bench(fn, --rep-ms)``, their order alternating; the median round is reported, with the fastest and
slowest. One JSON line per
(shape, case, kind) goes to stdout and ``$OUT/config_ab.jsonl`` (or ``--out``); a case that does not fit the GPU's
memory gets a "skipped" line instead, the other cases still run, and the exit status is 1.
"""

import argparse
import json
import os
import statistics
import sys

import torch

from titan_mok.bench.grouped_ffn import (SHAPES, TOKENS_PER_GPU, Case, bench, comma_choices, gemms_by_kind,
                                        route_counts, use_growing_segments, wgrads_by_weight)
from titan_mok.kernels import grouped_gemm as gg

CASES = ("EP=1 balanced", "EP=1 skewed", "EP=2 balanced", "EP=2 skewed", "8x4096")
WGRAD = "wgrad/"  # the weight gradient's entries: "wgrad/" + a _WGRAD_CONFIGS key
WGRAD_LOOPS = (WGRAD + "flat", WGRAD + "rows")  # always a config; "wgrad/*_ws*" may be null


def committed_configs(chip: str | None = None) -> dict:
    """Both config tables a chip reads (None: this process's, gg.current_chip) as one: its tile configs' entries,
    and _WGRAD_CONFIGS' under "wgrad/<loop>"."""
    return {**gg.mm_configs(chip), **{WGRAD + loop: cfg for loop, cfg in gg._WGRAD_CONFIGS.items()}}


def install(configs: dict, chip: str | None = None):
    """Make configs (committed_configs()'s form) the config tables a chip reads (None: this process's)."""
    table = gg.mm_configs(chip)
    table.clear()
    table.update({k: v for k, v in configs.items() if not k.startswith(WGRAD)})
    gg._WGRAD_CONFIGS.clear()
    gg._WGRAD_CONFIGS.update({k.removeprefix(WGRAD): v for k, v in configs.items() if k.startswith(WGRAD)})


def variant_configs(committed: dict, sets: list[str], unsets: list[str]) -> dict:
    """committed with each "KEY=JSON" of sets merged in and each KEY of unsets removed."""
    configs = dict(committed)
    for item in sets:
        key, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected KEY=JSON, e.g. 'bf16/plain={{\"HALF_TILES\": false}}'")
        _check_key(key, committed, "--set")
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--set {key}: {text!r} is not JSON ({e})") from None
        if value is None and key not in WGRAD_LOOPS:
            configs[key] = None
        elif isinstance(value, dict):
            configs[key] = {**(configs.get(key) or {}), **value}
        else:
            allowed = "a JSON object" if key in WGRAD_LOOPS else "a JSON object or null"
            raise ValueError(f"--set {key}: the value must be {allowed}, got {text!r}")
    for key in unsets:
        if key.startswith(WGRAD):
            raise ValueError(f"--unset {key}: the weight gradient's entries stay; --set it instead")
        if key not in configs:
            raise ValueError(f"--unset {key}: no such entry; entries: {', '.join(sorted(configs))}")
        del configs[key]
    return configs


def _check_key(key: str, committed: dict, flag: str):
    base, _, variant = key.partition("@")
    if base not in committed or variant not in ("", "few_rows", "many_rows") or (variant and base.startswith(WGRAD)):
        raise ValueError(f"{flag} {key}: not a config key (an _MM_CONFIGS key, one of them + '@few_rows' or "
                         f"'@many_rows', or a weight-gradient loop); keys: {', '.join(sorted(committed))}")


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


def compare(fn, configs: dict[str, dict], rounds: int, rep_ms: float, bench) -> dict:
    """Bits of fn under configs["variant"] against configs["committed"], then the median times
    (each round ``bench(fn, rep_ms)``) and each config's [fastest, slowest] round."""
    def use(name):
        install(configs[name])

    use("committed")
    ref = _outputs(fn)
    use("variant")
    bits_equal = all(torch.equal(a, b) for a, b in zip(ref, _outputs(fn, keep=False)))
    del ref
    times = timed_rounds({name: fn for name in configs}, rounds, rep_ms, bench, before=use)
    use("committed")
    return {"bits_equal": bits_equal, **times}


def timed_rounds(fns: dict, rounds: int, rep_ms: float, bench, before=lambda name: None) -> dict:
    """Each of fns timed in ``rounds`` rounds of ``bench(fn, rep_ms)`` (``before(name)`` first), their order
    alternating between rounds so that clock and thermal drift meet all alike: "<name>_ms" the median round,
    "<name>_range_ms" [fastest, slowest]."""
    times = {name: [] for name in fns}
    for r in range(rounds):
        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            before(name)
            times[name].append(bench(fns[name], rep_ms))
    # the fastest and slowest round beside the median: the same code's rounds spread by up to ~10% on the
    # H200 (NOTES.md, session 18), which bounds the differences a run can show
    return {**{f"{name}_ms": round(statistics.median(t), 4) for name, t in times.items()},
            **{f"{name}_range_ms": [round(min(t), 4), round(max(t), 4)] for name, t in times.items()}}


def gemms_to_compare(c, args) -> dict:
    """The GEMMs of case c whose config table the variant changes (both tables' for an A/A run)."""
    changed = _changed_keys(args)
    mm = not changed or any(not k.startswith(WGRAD) for k in changed)
    wgrad = not changed or any(k.startswith(WGRAD) for k in changed)
    return {**(gemms_by_kind(c, args.precision) if mm else {}),
            **(wgrads_by_weight(c, args.precision) if wgrad else {})}


def _changed_keys(args) -> list[str]:
    return [item.partition("=")[0] for item in args.sets] + args.unsets


def add_ab_args(p: argparse.ArgumentParser, rounds: int, rep_ms: float):
    """The flags of the GEMM A/B tools (this one and kernel_ab): precision, E4M3 MMAs, shapes, cases, rounds,
    output folder."""
    p.add_argument("--precision", choices=["bf16", "mxfp8"], required=True)
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--rep-ms", type=float, default=rep_ms)
    p.add_argument("--out", default=os.environ.get("OUT", "."))


def add_variant_args(p: argparse.ArgumentParser):
    """The flags that make a config variant (variant_configs): --set KEY=JSON and --unset KEY, repeatable; this
    tool's, and bench.sass's to compile the variant offline."""
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=JSON",
                   help="merge a JSON object into a config entry (or null: make it None)")
    p.add_argument("--unset", dest="unsets", action="append", default=[], metavar="KEY",
                   help="remove a grouped_mm config entry")


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
    committed = committed_configs()
    try:
        configs = {"committed": committed, "variant": variant_configs(committed, args.sets, args.unsets)}
    except ValueError as e:
        p.error(str(e))
    os.makedirs(args.out, exist_ok=True)
    # line-buffered: a run cut short by a time limit keeps the lines it measured
    with open(os.path.join(args.out, "config_ab.jsonl"), "a", buffering=1) as log:
        log.write(json.dumps({"sets": args.sets, "unsets": args.unsets, "precision": args.precision}) + "\n")
        skipped = run_cases(shapes, cases, lambda shape, case: ab_case(shape, case, args, configs, log), log)
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


def ab_case(shape: str, case: str, args, configs: dict, log):
    """One case's GEMMs compared and timed, a JSON line each. A function of its own so that nothing holds the
    case's tensors (tens of GB at EP=1) once it returns: a loop variable left bound to its last GEMM did, and the
    next case ran out of memory on an 80 GB H100 (NOTES.md, session 31)."""
    dim_h, dim_i, _, _ = SHAPES[shape]
    c = Case(dim_h, dim_i, case_counts(shape, case))
    for key, fn in gemms_to_compare(c, args).items():
        rec = {"shape": shape, "case": case, "kind": key, **compare(fn, configs, args.rounds, args.rep_ms, bench)}
        print(json.dumps(rec), flush=True)
        log.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
