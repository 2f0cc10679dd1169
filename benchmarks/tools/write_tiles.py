"""Benchmark: the HBM write rate of the weight gradient's output pattern, with nothing else running.

    python3 -m benchmarks.tools.write_tiles [--shapes kimi,...] [--tiles 128x256,64x256,32x512,16x1024] [--iters 20]

grouped_wgrad's flat loop writes each expert's gradient c [E, N, K] (bf16) in [BN, BK] tiles. One program per SM
loops over jobs (an expert's BN features and a run of its K tiles, consecutive jobs on the same expert's
neighbouring features) and stores the run's tiles in K order: rows of BK * 2 bytes, K * 2 bytes apart. Here a
Triton kernel makes the same stores with nothing to compute (each element holds its expert's index + 1, so a test
can check every byte) for each shape's largest gradient at EP=2 (w_gate [E, I, H] and w_down [E, H, I]), for
several tile shapes, and against a contiguous write of as many bytes (64 KB tiles). The question it answers:
whether that pattern, not the kernel around it, caps the weight gradient below its HBM floor. TB/s = bytes written /
median CUDA-event time of ``--iters`` runs after warm-up.
"""

import argparse
import json

import torch
import triton
import triton.language as tl

from benchmarks.tools.grouped_ffn import SHAPES, comma_choices
from titan_mok.bench.timing import median_ms

CONTIGUOUS_ROW = 2048  # elements: every shape's expert gradient is a multiple of it


@triton.jit
def _write_tiles_kernel(c_ptr, E, N, K, K_TILES_PER_JOB, BN: tl.constexpr, BK: tl.constexpr,
                        EVICTION: tl.constexpr):
    """c[e, f, k] = e + 1, in [BN, BK] tiles: job j = (expert, run of K_TILES_PER_JOB K tiles) times
    cdiv(N, BN) feature blocks, the feature block fastest (the flat loop's order); programs stride over jobs."""
    n_tiles = tl.cdiv(N, BN)
    runs = tl.cdiv(tl.cdiv(K, BK), K_TILES_PER_JOB)
    for t in range(tl.program_id(0), E * runs * n_tiles, tl.num_programs(0)):
        job = t // n_tiles
        e = job // runs
        k_first = (job % runs) * K_TILES_PER_JOB * BK
        f = (t % n_tiles) * BN + tl.arange(0, BN)
        value = tl.full((BN, BK), 1, tl.float32) * (e + 1).to(tl.float32)
        rows = c_ptr + e.to(tl.int64) * N * K + f[:, None].to(tl.int64) * K
        for i in range(K_TILES_PER_JOB):
            k = k_first + i * BK + tl.arange(0, BK)
            mask = (f < N)[:, None] & (k < K)[None, :]
            tl.store(rows + k[None, :], value.to(tl.bfloat16), mask=mask, eviction_policy=EVICTION)


def write_tiles(c_ENK: torch.Tensor, block_n: int, block_k: int, k_tiles_per_job: int, programs: int,
                evict_first: bool = False, num_warps: int = 8) -> torch.Tensor:
    """Fill c_ENK (contiguous bf16 [E, N, K]) with each expert's index + 1, in the flat loop's tile order."""
    if c_ENK.dtype != torch.bfloat16 or c_ENK.dim() != 3 or not c_ENK.is_contiguous():
        raise ValueError(f"write_tiles: c_ENK must be contiguous bfloat16 [E, N, K], got {c_ENK.dtype} "
                         f"{tuple(c_ENK.shape)}")
    E, N, K = c_ENK.shape
    _write_tiles_kernel[(programs,)](c_ENK, E, N, K, k_tiles_per_job, BN=block_n, BK=block_k,
                                     EVICTION="evict_first" if evict_first else "", num_warps=num_warps)
    return c_ENK


def written_reference(E: int, N: int, K: int, device="cpu") -> torch.Tensor:
    """What write_tiles leaves in c [E, N, K]: the definition the kernel must match."""
    return (torch.arange(1, E + 1, device=device, dtype=torch.float32)[:, None, None]
            .expand(E, N, K).to(torch.bfloat16))


def _tile(text: str) -> tuple[int, int]:
    try:
        bn, bk = (int(v) for v in text.split("x"))
    except ValueError:
        raise ValueError(f"--tiles: {text!r} is not BNxBK (e.g. 128x256)") from None
    if bn < 16 or bk < 16 or bn & (bn - 1) or bk & (bk - 1):
        raise ValueError(f"--tiles: {text!r}: BN and BK must be powers of two, at least 16")
    return bn, bk


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--tiles", default="128x256,64x256,128x128,32x512,16x1024",
                   help="comma-separated BNxBK tiles; 128x256 is the committed flat_ws kernel's program tile")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    shapes = comma_choices(p, "--shapes", args.shapes, SHAPES)
    try:
        tiles = [_tile(t) for t in args.tiles.split(",")]
    except ValueError as e:
        p.error(str(e))
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    for shape in shapes:
        dim_h, dim_i, num_experts, _ = SHAPES[shape]
        for weight, (n, k) in (("w_gate", (dim_i, dim_h)), ("w_down", (dim_h, dim_i))):
            c = torch.empty(num_experts // 2, n, k, dtype=torch.bfloat16, device="cuda")
            # the same bytes as 64 KB contiguous tiles (torch's fill_ is slower: 3.4 TB/s)
            rows = c.view(1, -1, CONTIGUOUS_ROW)
            ms = median_ms(lambda: write_tiles(rows, 16, CONTIGUOUS_ROW, 1, programs), args.iters, 3)
            rec = {"shape": shape, "weight": weight, "E": c.shape[0], "N": n, "K": k, "GB": c.numel() * 2 / 1e9,
                   "contiguous_tbps": c.numel() * 2 / ms / 1e9}
            for bn, bk in tiles:
                k_tiles = triton.cdiv(k, bk)  # the flat loop's jobs at EP=2: each expert's K tiles in one run
                for ef in (False, True):
                    ms = median_ms(lambda: write_tiles(c, bn, bk, k_tiles, programs, ef), args.iters, 3)
                    rec[f"{bn}x{bk}{'_evict_first' if ef else ''}_tbps"] = c.numel() * 2 / ms / 1e9
            assert torch.equal(c, written_reference(*c.shape, device="cuda")), "write_tiles missed elements"
            print(json.dumps({key: round(v, 3) if isinstance(v, float) else v for key, v in rec.items()}), flush=True)
            del c, rows
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
