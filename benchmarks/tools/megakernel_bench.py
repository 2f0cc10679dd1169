"""The MoK forward megakernel against today's triton path, routed experts' forward only, one GPU.

    python3 benchmarks/tools/megakernel_bench.py [--tokens 2048] [--ranks 1 2 4 8] [--experts 384] [--iters 30]
        [--comm-programs C] [--group-tiles G] [--lag LAG] [--ring-tiles Q] [--shared-dim I_S]
        [--block-m 64 128] [--gemm ptr tma] [--num-stages 3 4] [--precision bf16|mxfp8] [--trace]

Legend: P virtual ranks, T tokens per rank, K top-k, H hidden, I expert FFN size, E experts (all on this GPU).

Per P, on the same P·T tokens (random top-k routing, fp32 weights; a shared expert of I_S = --shared-dim, none
by default), ms by CUDA events, median of --iters after warm-up:
- triton: today's ``kernels = "triton"`` forward at EP = 1 (``fused_routed_experts``: schedule, pull, the Triton
  grouped FFN, push, slot reduction; separate launches; the shared expert as ``SharedExpert(use_triton=True)``
  runs it, the Triton FFN on all rows as one expert, before);
- mega P=1: the megakernel at EP = 1 on all P·T tokens;
- mega P=P: the megakernel at virtual EP = P, T tokens per rank (the protocol's cost against P=1: flags,
  per-rank rings and schedules, the programs split among ranks); the shared expert inside the launch.
Each megakernel output is checked bitwise against the triton path's first. Default shape: Kimi K2.7 Code's
experts (H 7168, I 2048, E 384, K 8). The megakernel runs every combination of --block-m (rows per tile), --gemm
(its item GEMMs' loads: pointer or TMA) and --num-stages (their K loops' pipeline depth), one line each against the
same triton timing (default: the config's, one variant); one the device cannot compile (its shared memory) says so,
and the others run. The last columns: the P=P launch's programs per rank, its item order (tiles per group, lag in
groups) and its ring per rank; TFLOP/s: the routed experts' GEMM FLOPs
(T·P·K·3·2·H·I) over the P=P launch's time, end to end (pull, FFN, push, reduction).

--precision mxfp8: the routed experts in MXFP8 on both paths (the triton path's Triton grouped FFN with
``precision="mxfp8"``; the megakernel quantizing rows on the pull, its ring and h holding MXFP8 values in bf16), the
shared expert bf16. Both read the same MXFP8 weight operands, made once before the timings (kept under one owner, as
a training step's microbatches read them), so neither time holds a weight quantization.

--trace: after each P=P timing, one more call of the traced kernel (``kernels/mok_megakernel.py``, Trace: each
program's wait, A-item and B-item time by %globaltimer) and where the compute programs' time went, as fractions of
the launch (first program start to last program end), averaged over every rank's compute programs: A items, B items,
waits (a tile not yet pulled, a tile's h not yet complete), claims and bookkeeping, and the tail (ended before the
launch did: no item left for it); then the mean time of one A and one B item, and the communication programs' pull
and wait shares. The traced kernel is a separate compilation (its times are its own; the counts are exact).
"""

import argparse
import dataclasses
import itertools
import statistics

import torch
from triton.runtime.errors import OutOfResources

from titan_mok.kernels.grouped_ffn import grouped_swiglu_ffn
from titan_mok.kernels.mok_megakernel import GEMM_LOADS, TRACE_FIELDS, SharedFFN
from titan_mok.moe.fused import fused_routed_experts
from titan_mok.kernels.tile_configs import PRECISIONS
from titan_mok.moe.megakernel import MegakernelConfig, _WORKSPACES, megakernel_routed_experts


def time_ms(fn, iters: int) -> float:
    """Median of iters calls, each timed by CUDA events (after two warm-up calls)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="T: tokens per virtual rank")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--expert-dim", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=384)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--comm-programs", type=int, default=None, help="per rank (default: the config's)")
    parser.add_argument("--ring-tiles", type=int, default=None, help="per rank (default: the config's)")
    parser.add_argument("--group-tiles", type=int, default=MegakernelConfig.group_tiles, help="tiles per item step")
    parser.add_argument("--lag", type=int, default=MegakernelConfig.lag, help="groups A items run ahead of B items")
    parser.add_argument("--num-stages", type=int, nargs="+", default=[MegakernelConfig.num_stages],
                        help="GEMM pipeline depths")
    parser.add_argument("--block-m", type=int, nargs="+", default=[None], help="rows per tile (default: the config's"
                        " choice by rows per expert)")
    parser.add_argument("--gemm", nargs="+", default=[None], choices=GEMM_LOADS,
                        help="the item GEMMs' loads (default: the config's choice)")
    parser.add_argument("--shared-dim", type=int, default=0, help="I_S of a shared expert (0: none)")
    parser.add_argument("--precision", default="bf16", choices=PRECISIONS, help="the routed experts' GEMMs")
    parser.add_argument("--trace", action="store_true", help="also where each P=P launch's time went (docstring)")
    opts = parser.parse_args()
    dim_h, dim_i, num_experts, top_k = opts.hidden, opts.expert_dim, opts.experts, opts.top_k
    g = torch.Generator(device="cuda").manual_seed(0)
    bf16 = dict(dtype=torch.bfloat16, device="cuda")
    expert_weights = tuple((torch.randn(*shape, generator=g, **bf16) * 0.02).contiguous()
                           for shape in ((num_experts, dim_i, dim_h), (num_experts, dim_i, dim_h),
                                         (num_experts, dim_h, dim_i)))
    shared_weights = tuple((torch.randn(*shape, generator=g, **bf16) * 0.02).contiguous()
                           for shape in ((opts.shared_dim, dim_h), (opts.shared_dim, dim_h), (dim_h, opts.shared_dim))
                           ) if opts.shared_dim else None
    shared_expert = SharedFFN(*shared_weights) if shared_weights else None
    base = MegakernelConfig(comm_programs=opts.comm_programs, ring_tiles=opts.ring_tiles,
                            group_tiles=opts.group_tiles, lag=opts.lag)
    configs = [dataclasses.replace(base, block_m=block_m, gemm=gemm, num_stages=stages)
               for block_m, gemm, stages in itertools.product(opts.block_m, opts.gemm, opts.num_stages)]
    # the MXFP8 weight operands, kept under this owner for both paths (the weights never change here)
    owner = WeightsOwner()
    kept = dict(precision=opts.precision, weights_owner=owner, weight_sources=expert_weights)
    print(f"{torch.cuda.get_device_name()}, H {dim_h}, I {dim_i}, E {num_experts}, K {top_k}, T {opts.tokens} per "
          f"rank, shared expert I_S {opts.shared_dim or 'none'}, routed experts {opts.precision}; ms, median of "
          f"{opts.iters}")
    print(f"{'P':>2} {'tokens':>7} {'variant':>14} {'triton':>8} {'mega P=1':>9} {'mega P=P':>9} {'P=1/triton':>10} "
          f"{'P=P/triton':>10} {'P=P/P=1':>8} {'TFLOP/s':>7}  programs/rank (comm+compute), group x lag, ring/rank")
    for ranks in opts.ranks:
        tokens = ranks * opts.tokens
        x_TH = torch.randn(tokens, dim_h, generator=g, **bf16)
        ids_TK = torch.rand(tokens, num_experts, generator=g, device="cuda").argsort(dim=1)[:, :top_k]
        weights_TK = torch.rand(tokens, top_k, generator=g, device="cuda")

        def experts(x_RH, group_end_E):
            return grouped_swiglu_ffn(x_RH, group_end_E, *expert_weights, use_triton=True, **kept)

        def triton_path():
            shared_TH = None
            if shared_weights:  # SharedExpert(use_triton=True)'s forward: every row in one expert's group
                group_end = torch.full((1,), tokens, dtype=torch.int32, device="cuda")
                shared_TH = grouped_swiglu_ffn(x_TH, group_end, *(w[None] for w in shared_weights), use_triton=True)
            return fused_routed_experts(x_TH, weights_TK, ids_TK, shared_TH, None, experts, num_experts=num_experts)

        def mega(parts, config, trace=None):
            out = megakernel_routed_experts(list(x_TH.chunk(parts)), list(weights_TK.chunk(parts)),
                                            list(ids_TK.chunk(parts)), [None] * parts, expert_weights,
                                            num_experts=num_experts, config=config, shared_expert=shared_expert,
                                            trace=trace, **kept)
            return torch.cat(out)

        ffn_flops = tokens * top_k * 3 * 2 * dim_h * dim_i  # the routed experts' GEMMs
        with torch.no_grad():
            want = triton_path()
            triton_ms = time_ms(triton_path, opts.iters)
        for config in configs:
            row = []
            try:
                with torch.no_grad():
                    for parts in sorted({1, ranks}):
                        if not torch.equal(mega(parts, config), want):
                            raise SystemExit(f"P = {ranks}, {variant_name(config)}: the megakernel at {parts} ranks "
                                             "differs from the triton path")
                        row.append(time_ms(lambda: mega(parts, config), opts.iters))
            except OutOfResources as e:  # e.g. 5 stages of 128-row tiles: 240 KB of shared memory; the others run
                print(f"{ranks:2} {tokens:7} {variant_name(config):>14} {triton_ms:8.3f}  not compiled: {e}",
                      flush=True)
                _WORKSPACES.clear()
                continue
            row += row[-1:] * (2 - len(row))  # P = 1: one megakernel run
            ws = [w for key, w in _WORKSPACES.items() if key[1:3] == (ranks, opts.tokens)][-1]
            ring_mb = sum(b[0].numel() * b.element_size() for b in (ws.bufs.ring_VQMH, ws.bufs.h_VQMI)) / 1e6
            print(f"{ranks:2} {tokens:7} {variant_name(config):>14} {triton_ms:8.3f} {row[0]:9.3f} {row[1]:9.3f} "
                  f"{row[0] / triton_ms:10.3f} {row[1] / triton_ms:10.3f} {row[1] / row[0]:8.3f} "
                  f"{ffn_flops / row[1] / 1e9:7.0f}  "
                  f"{ws.shape.comm_programs}+{ws.shape.compute_programs}, {ws.shape.group_tiles} x {ws.shape.lag}, "
                  f"{ws.bufs.ring_tiles} tiles ({ring_mb:.0f} MB)", flush=True)
            if opts.trace:
                trace = torch.zeros(ws.shape.programs, len(TRACE_FIELDS), dtype=torch.int64, device="cuda")
                with torch.no_grad():
                    mega(ranks, config, trace)
                print("   trace: " + trace_summary(trace.cpu(), ws.shape.comm_programs), flush=True)
            _WORKSPACES.clear()  # free this variant's buffers before the next
            torch.cuda.empty_cache()


def trace_summary(trace, comm_programs: int) -> str:
    """One line: where a traced launch's time went (module docstring, --trace)."""
    f = {name: trace[:, i].double() for i, name in enumerate(TRACE_FIELDS)}
    start, end = f["start_ns"].min(), f["end_ns"].max()
    span = (end - start).item()
    compute, comm = f["role"] == 1, f["role"] == 0
    share = lambda name, rows: (f[name][rows].mean() / span).item()  # noqa: E731
    busy = f["end_ns"] - f["start_ns"]
    other = busy - f["wait_ns"] - f["a_ns"] - f["b_ns"]
    per_item = lambda name, items: (f[name][compute].sum() / f[items][compute].sum() / 1e3).item()  # noqa: E731
    return (f"span {span / 1e6:.3f} ms; compute programs: A {share('a_ns', compute):.3f}, "
            f"B {share('b_ns', compute):.3f}, waits {share('wait_ns', compute):.3f}, "
            f"claims/other {(other[compute].mean() / span).item():.3f}, "
            f"head {((f['start_ns'][compute] - start).mean() / span).item():.3f}, "
            f"tail {((end - f['end_ns'][compute]).mean() / span).item():.3f}; "
            f"A item {per_item('a_ns', 'a_items'):.1f} us, B item {per_item('b_ns', 'b_items'):.1f} us; "
            f"{comm_programs} comm/rank: pulls {share('a_ns', comm):.3f}, waits {share('wait_ns', comm):.3f}, "
            f"{(f['a_ns'][comm].sum() / f['a_items'][comm].sum() / 1e3).item():.1f} us per tile")


class WeightsOwner:
    """Who the MXFP8 weight operands are kept under (``kernels/weight_cache.py``)."""


def variant_name(config: MegakernelConfig) -> str:
    return f"{config.gemm or 'auto'} M{config.block_m or 'auto'} S{config.num_stages}"


if __name__ == "__main__":
    main()
