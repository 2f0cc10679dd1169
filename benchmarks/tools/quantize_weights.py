"""Benchmark: both MXFP8 layouts of the routed-expert weights, two single-layout passes against one pass.

An MXFP8 training step quantizes each expert weight in two layouts: by two single-layout passes
(``grouped_ffn.weight_operand`` along 2 and 1) or by one pass (``mxfp8_quantize_both``,
kernels/mxfp8_quant_both.py, timed at each tile of ``--tiles``); both against the HBM floor.

    python3 -m benchmarks.tools.quantize_weights [--shape kimi] [--experts 96] [--tiles 64x128x4,...] [--out FILE]

Weights: the shape's w_gate, w_up [E, I, H] and w_down [E, H, I] in bf16, ``--experts`` of them: Kimi's 384
(33.8 GB of bf16 and 34.8 GB of MXFP8 layouts) leave too little of an 80 GB GPU for the outputs of both
methods, so 96 by default (a quarter: the ms scale by 4). Before timing, every tile's outputs are compared
with the single passes' bit for bit (the run stops on a difference); a tile the GPU cannot run (too many
registers or too much shared memory) is reported as such and not timed.

Floor: bytes / HBM bandwidth (a 4 GiB device copy's bytes read + written per second, same run). Two passes read
the bf16 weights twice, one pass once; both write (1 + 1/32) bytes per element per layout.
"""

import argparse
import json

import torch
import triton
from triton.runtime.errors import OutOfResources

from benchmarks.tools.grouped_ffn import SHAPES, bench, measure_hbm_tbps
from titan_mok.kernels import grouped_ffn
from titan_mok.kernels.mxfp8_quant_both import DEFAULT_TILE, mxfp8_quantize_both

NAMES = ("w_gate", "w_up", "w_down")


def expert_weights(shape: str, experts: int, device: str = "cuda") -> dict[str, torch.Tensor]:
    """The shape's three expert weights for ``experts`` experts, bf16 N(0, 0.02) (the scale training starts from)."""
    dim_h, dim_i, _, _ = SHAPES[shape]
    g = torch.Generator(device=device).manual_seed(0)
    dims = {"w_gate": (dim_i, dim_h), "w_up": (dim_i, dim_h), "w_down": (dim_h, dim_i)}
    return {n: (torch.randn(experts, *dims[n], device=device, generator=g) * 0.02).to(torch.bfloat16)
            for n in NAMES}


def two_passes(weights: dict) -> None:
    for name, w in weights.items():
        grouped_ffn.weight_operand(w, "mxfp8", 2, name)
        grouped_ffn.weight_operand(w, "mxfp8", 1, name)


def one_pass(weights: dict, tile: tuple[int, int, int]) -> None:
    for name, w in weights.items():
        mxfp8_quantize_both(w, name, mma_order=True, tile=tile)


def check_bits(weights: dict, tile: tuple[int, int, int]) -> None:
    """Raises unless ``tile``'s one pass gives every weight's two single-pass operands bit for bit."""
    for name, w in weights.items():
        both = mxfp8_quantize_both(w, name, mma_order=True, tile=tile)
        for along, got in zip((2, 1), both):
            want = grouped_ffn.weight_operand(w, "mxfp8", along, name)
            for part in ("data", "scale"):
                if not torch.equal(getattr(got, part).view(torch.uint8), getattr(want, part).view(torch.uint8)):
                    raise AssertionError(f"tile {tile}: {name} along {along} {part} differs from the single pass")


def floors_ms(numel: int, hbm_tbps: float) -> dict[str, float]:
    """HBM floors (ms) of quantizing ``numel`` weight elements to both layouts, by method."""
    written = 2 * (1 + 1 / 32) * numel
    return {"two_passes": (2 * 2 * numel + written) / hbm_tbps / 1e9,
            "one_pass": (2 * numel + written) / hbm_tbps / 1e9}


def run(weights: dict, tiles: list, hbm_tbps: float, rep_ms: float, timer=bench) -> dict:
    """ms and floor fraction of the two single passes and of one pass at each tile (bits checked first)."""
    numel = sum(w.numel() for w in weights.values())
    floors = floors_ms(numel, hbm_tbps)
    runnable, failed = [], {}
    for tile in tiles:
        try:
            check_bits(weights, tile)
            runnable.append(tile)
        except OutOfResources as e:
            failed["one_pass " + "x".join(map(str, tile))] = str(e)
    timed = {"two_passes": timer(lambda: two_passes(weights), rep_ms)}
    for tile in runnable:
        timed["one_pass " + "x".join(map(str, tile))] = timer(lambda t=tile: one_pass(weights, t), rep_ms)
    return {"weight_elements": numel, "hbm_tbps": hbm_tbps, "floors_ms": floors, "ms": timed,
            "of_floor": {k: floors[k.split(" ")[0]] / ms for k, ms in timed.items()}, "failed": failed}


def parse_tiles(parser, text: str) -> list[tuple[int, int, int]]:
    try:
        tiles = [tuple(int(v) for v in t.split("x")) for t in text.split(",")]
    except ValueError:
        parser.error(f"--tiles: comma-separated BXxBYxWARPS, e.g. 64x128x4; got {text!r}")
    if any(len(t) != 3 for t in tiles):
        parser.error(f"--tiles: each tile is BXxBYxWARPS (three numbers), got {text!r}")
    return tiles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="kimi")
    parser.add_argument("--experts", type=int, default=96)
    default_tiles = ["x".join(map(str, DEFAULT_TILE)), "32x128x4", "64x64x4", "64x128x8", "128x64x4", "128x128x8"]
    parser.add_argument("--tiles", default=",".join(default_tiles), help="one-pass tiles, BXxBYxWARPS, the first the "
                                                                         "default (mxfp8_quant_both.DEFAULT_TILE)")
    parser.add_argument("--rep-ms", type=float, default=500)
    parser.add_argument("--out", default=None, help="also append the result as a JSON line to this file")
    opts = parser.parse_args()
    if opts.experts < 1:
        parser.error(f"--experts must be at least 1, got {opts.experts}")
    tiles = parse_tiles(parser, opts.tiles)
    hbm_tbps = measure_hbm_tbps()
    weights = expert_weights(opts.shape, opts.experts)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "shape": opts.shape, "experts": opts.experts, **run(weights, tiles, hbm_tbps, opts.rep_ms)}
    print(f"{opts.shape}, {opts.experts} experts: {result['weight_elements'] * 2 / 1e9:.1f} GB of bf16 weights, "
          f"HBM {hbm_tbps:.2f} TB/s (copy); floors: two passes {result['floors_ms']['two_passes']:.2f} ms, "
          f"one pass {result['floors_ms']['one_pass']:.2f} ms")
    for key, ms in result["ms"].items():
        print(f"  {key:24s} {ms:8.2f} ms  floor/time {result['of_floor'][key]:.2f}")
    for key, error in result["failed"].items():
        print(f"  {key:24s} not run: {error}")
    if opts.out:
        with open(opts.out, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
