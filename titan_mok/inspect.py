"""Parameter and FLOP counts of a registered model flavor, built on the meta device.

    python -m titan_mok.inspect --model deepseek_v4_pro --flavor full [--seq-len 4096] [--json]

Prints total parameters, active parameters per token (routed experts count
top-k / E), training FLOPs per token (the model's own ``get_nparams_and_flops``,
the number TorchTitan's MFU uses) and a per-layer breakdown. Nothing is
allocated: a full flavor takes seconds.
"""

import argparse
import copy
import json
import sys

import torch

from titan_mok import registry
from titan_mok.models.common.params import count_params


def inspect_model(name: str, flavor: str, seq_len: int = 4096) -> dict:
    """Counts of ``name``/``flavor``; ValueError naming the valid choices otherwise."""
    flavors = registry.flavors(name)  # raises on an unknown model, listing the registered ones
    if flavor not in flavors:
        raise ValueError(f"unknown flavor {flavor!r} of {name}; choose one of {list(flavors)}")
    if seq_len <= 0:
        raise ValueError(f"--seq-len must be > 0, got {seq_len}")
    model_args = copy.deepcopy(flavors[flavor])
    model_cls = registry.model_module(name).get_train_spec().model_cls
    with torch.device("meta"):
        model = model_cls(model_args)
    counts = count_params(model)
    _, flops = model_args.get_nparams_and_flops(model, seq_len)
    layers = []
    for layer_id, block in model.layers.items():
        c = count_params(block)
        kind = type(block).__name__ + (" (MoE)" if getattr(block, "moe_enabled", False) else "")
        layers.append({"layer": layer_id, "kind": kind, "total_params": c.total, "active_params": c.active})
    return {
        "model": name,
        "flavor": flavor,
        "seq_len": seq_len,
        "total_params": counts.total,
        "active_params": counts.active,
        "flops_per_token": flops,
        "non_layer_params": counts.total - sum(layer["total_params"] for layer in layers),
        "layers": layers,
    }


def _group_layers(layers: list[dict]) -> list[tuple[str, dict]]:
    """Runs of consecutive identical layers → ("first–last", layer)."""
    groups: list[list[dict]] = []
    for layer in layers:
        same = groups and all(groups[-1][-1][k] == layer[k] for k in ("kind", "total_params", "active_params"))
        if same:
            groups[-1].append(layer)
        else:
            groups.append([layer])
    return [(g[0]["layer"] if len(g) == 1 else f"{g[0]['layer']}-{g[-1]['layer']}", g[0]) for g in groups]


def format_report(report: dict) -> str:
    lines = [
        f"{report['model']} / {report['flavor']} (seq_len {report['seq_len']})",
        f"  total params       {report['total_params']:>20,}  ({report['total_params'] / 1e9:.2f} B)",
        f"  active params/tok  {report['active_params']:>20,}  ({report['active_params'] / 1e9:.2f} B)",
        f"  train FLOPs/tok    {report['flops_per_token']:>20,}  ({report['flops_per_token'] / 1e12:.3f} TFLOP)",
        f"  outside layers     {report['non_layer_params']:>20,}  (embedding, norm, head, any block not in model.layers)",
        f"  {'layers':<10} {'kind':<26} {'params each':>16} {'active each':>16}",
    ]
    for span, layer in _group_layers(report["layers"]):
        lines.append(f"  {span:<10} {layer['kind']:<26} {layer['total_params']:>16,} {layer['active_params']:>16,}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m titan_mok.inspect", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help=f"one of {list(registry.MODELS)}")
    parser.add_argument("--flavor", required=True, help="e.g. debug, h200, full")
    parser.add_argument("--seq-len", type=int, default=4096, help="sequence length of the attention FLOPs (default 4096)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    try:
        report = inspect_model(args.model, args.flavor, args.seq_len)
    except ValueError as e:
        sys.exit(f"titan_mok.inspect: {e}")
    print(json.dumps(report, indent=1) if args.json else format_report(report))


if __name__ == "__main__":
    main()
