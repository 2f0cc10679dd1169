"""The MoK megakernel's training backward on one GPU: its dgrad launch at virtual EP and the weight gradients.

    python3 benchmarks/tools/megakernel_dgrad_bench.py [--tokens 2048] [--ranks 1 8] [--experts 384] [--iters 20]
        [--block-m 64 128] [--gemm ptr tma] [--precision bf16|mxfp8]

Legend: P virtual ranks, T tokens per rank, K top-k, H hidden, I expert FFN size, E experts (all on this GPU),
R = P·T·K grouped rows.

Per P, on P·T tokens (random top-k routing; random dY, combine weights and kept g, u rows), ms by CUDA events,
median of --iters after two warm-ups:
- triton (bf16 only): the fused path's two dgrad GEMM launches on the P=1 call's grouped rows
  (``grouped_down_dgrad_swiglu``, ``grouped_mm_sum``), without its pull, push and slot reduction: the GEMMs the
  launch's items must match;
- dgrad P=1 / P=P: ``megakernel_routed_dgrad`` at EP = 1 on all P·T tokens / at virtual EP = P (T per rank): the
  w·dY rows pulled, the down-projection dgrad through the SwiGLU backward, the gate/up dgrad, the dX rows pushed,
  each token's K rows summed in slot order (the protocol's cost: P=P / P=1); one line per combination of
  --block-m (rows per tile; default the config's) and --gemm (the items' loads; default the config's);
- wgrad: ``grouped_wgrads`` on the P=1 call's grouped rows (dgate with x, dup with x, dY with h): the three
  weight gradients, each expert's rows in a fixed order, as the layer's backward runs them after the launch (the
  same work at any P).
TFLOP/s: each part's GEMM FLOPs (dgrad and wgrad 6·R·H·I each) over its time; "of ceiling": that over the bf16
dense matmul rate measured in the run (``titan_mok.bench.layer.measure_ceilings``: an 8192³ matmul). Default shape:
Kimi K2.7 Code's experts (H 7168, I 2048, E 384, K 8).
"""

import argparse
import itertools

import torch

from benchmarks.tools.megakernel_bench import time_ms
from titan_mok.bench.layer import measure_ceilings
from titan_mok.kernels.grouped_ffn import dgrad_weight_operands
from titan_mok.kernels.grouped_gemm import grouped_down_dgrad_swiglu, grouped_mm_sum, grouped_wgrads
from titan_mok.kernels.mok_megakernel import GEMM_LOADS
from titan_mok.kernels.tile_configs import PRECISIONS
from titan_mok.moe.megakernel import MegakernelConfig
from titan_mok.moe.megakernel_bwd import _WORKSPACES, megakernel_routed_dgrad


def gemms_ms(ep1, g_RI, u_RI, expert_weights, precision: str, iters: int) -> tuple[float, float]:
    """(triton dgrad ms or NaN under MXFP8, wgrad ms) on one EP = 1 call's grouped rows ep1."""
    g = torch.Generator(device="cuda").manual_seed(1)
    triton_ms = float("nan")
    if precision == "bf16":
        w_gate, w_up, w_down = dgrad_weight_operands(expert_weights, "bf16")

        def triton_dgrad():
            dgate, dup = grouped_down_dgrad_swiglu(ep1.dy_RH, ep1.group_end_L, w_down, g_RI, u_RI, None)
            grouped_mm_sum(dgate, dup, ep1.group_end_L, w_gate, w_up)
        triton_ms = time_ms(triton_dgrad, iters)
    rows, bf16 = ep1.dy_RH.shape[0], dict(dtype=torch.bfloat16, device="cuda")
    x_RH = torch.randn(rows, ep1.dy_RH.shape[1], generator=g, **bf16)
    h_RI = torch.randn(rows, ep1.dgate_RI.shape[1], generator=g, **bf16)
    pairs = [(ep1.dgate_RI, x_RH), (ep1.dup_RI, x_RH), (ep1.dy_RH, h_RI)]

    def wgrads():  # one gradient alive at a time (E·I·H·2 bytes each: 11.3 GB at Kimi's 384 experts)
        for _ in grouped_wgrads(pairs, ep1.group_end_L, precision):
            pass
    return triton_ms, time_ms(wgrads, iters)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="T: tokens per virtual rank")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--expert-dim", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=384)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--block-m", type=int, nargs="+", default=[None], help="rows per tile (default: the config's)")
    parser.add_argument("--gemm", nargs="+", default=[None], choices=GEMM_LOADS,
                        help="the items' operand loads (default: the config's)")
    parser.add_argument("--precision", default="bf16", choices=PRECISIONS, help="the routed experts' GEMMs")
    opts = parser.parse_args()
    dim_h, dim_i, num_experts, top_k = opts.hidden, opts.expert_dim, opts.experts, opts.top_k
    ceiling, _ = measure_ceilings(torch.device("cuda"), torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    bf16 = dict(dtype=torch.bfloat16, device="cuda")
    expert_weights = tuple((torch.randn(*shape, generator=g, **bf16) * 0.02).contiguous()
                           for shape in ((num_experts, dim_i, dim_h), (num_experts, dim_i, dim_h),
                                         (num_experts, dim_h, dim_i)))
    # keeps the MXFP8 dgrad operands (a weak key: a module), made once before the timings as a step's microbatches
    # read them
    owner = torch.nn.Module()
    variants = [MegakernelConfig(block_m=m, gemm=gemm) for m, gemm in itertools.product(opts.block_m, opts.gemm)]
    print(f"{torch.cuda.get_device_name()}, {opts.precision}, H {dim_h}, I {dim_i}, E {num_experts}, K {top_k}, "
          f"T {opts.tokens} per rank; bf16 ceiling {ceiling:.1f} TFLOP/s (this run); ms, median of {opts.iters}")
    print(f"{'P':>2} {'tokens':>7} {'block_m':>7} {'gemm':>4} {'triton':>8} {'dgrad P=1':>9} {'dgrad P=P':>9} "
          f"{'P=P/P=1':>8} {'TFLOP/s':>7} {'of ceiling':>10} {'wgrad':>8} {'TFLOP/s':>7} {'of ceiling':>10}")
    for ranks in opts.ranks:
        tokens = ranks * opts.tokens
        rows = tokens * top_k
        flops = 6 * rows * dim_h * dim_i
        dout_TH = torch.randn(tokens, dim_h, generator=g, **bf16) * 0.01
        ids_TK = torch.rand(tokens, num_experts, generator=g, device="cuda").argsort(dim=1)[:, :top_k]
        weights_TK = torch.rand(tokens, top_k, generator=g, device="cuda")
        # g, u rows: each rank's sized for all P·T·K rows (its schedule's most), read only, so one pair serves all
        g_RI, u_RI = (torch.randn(rows, dim_i, generator=g, **bf16) for _ in range(2))

        def dgrad(parts, config):
            split = lambda t: list(t.chunk(parts))  # noqa: E731
            return lambda: megakernel_routed_dgrad(
                split(dout_TH), split(weights_TK), split(ids_TK), [g_RI] * parts, [u_RI] * parts, expert_weights,
                num_experts=num_experts, config=config, precision=opts.precision, weights_owner=owner,
                weight_sources=expert_weights)

        with torch.no_grad():
            (ep1,) = dgrad(1, MegakernelConfig())()  # the grouped rows the GEMM-only timings read
            triton_ms, wgrad_ms = gemms_ms(ep1, g_RI, u_RI, expert_weights, opts.precision, opts.iters)
            del ep1
            for config in variants:
                label = f"{ranks:2} {tokens:7} {config.block_m or 'auto':>7} {config.gemm or 'auto':>4}"
                ms = {}
                for parts in sorted({1, ranks}):
                    try:
                        ms[parts] = time_ms(dgrad(parts, config), opts.iters)
                    except (ValueError, RuntimeError) as error:  # a variant this launch refuses: say so, go on
                        print(f"{label} P={parts}: {error}")
                        break
                    finally:
                        _WORKSPACES.clear()  # free this launch's buffers (sized for every rank's P·N rows)
                        torch.cuda.empty_cache()
                if len(ms) < len({1, ranks}):
                    continue
                mega = ms[ranks]
                print(f"{label} {triton_ms:8.3f} {ms[1]:9.3f} {mega:9.3f} {mega / ms[1]:8.3f} "
                      f"{flops / mega / 1e9:7.0f} {flops / mega / 1e9 / ceiling:10.3f} {wgrad_ms:8.3f} "
                      f"{flops / wgrad_ms / 1e9:7.0f} {flops / wgrad_ms / 1e9 / ceiling:10.3f}", flush=True)


if __name__ == "__main__":
    main()
