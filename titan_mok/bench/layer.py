"""MoE-layer benchmark: TorchTitan 0.2.2's own MoE layer (the baseline) against titan-mok's.

    python -m titan_mok.bench.layer --shape kimi_k2_7_code --impl titan,auto,triton --precision bf16
    torchrun --nproc_per_node 2 -m titan_mok.bench.layer --precision bf16,mxfp8 --routing balanced,skewed

EP degree = the torchrun world size (one ep group; 1: no expert parallelism). Implementations
(``--impl``): the ``IMPLS`` table below, also listed by ``--help``.

Layer: each model's ``--flavor`` (default ``full``) MoE arguments with top-k routing (hash routing
off). Every parameter is drawn N(0, 0.02) from a seed of its titan-mok state-dict name, so every
implementation holds the same router gate, experts and shared expert (TorchTitan's ``w1, w3, w2``
are titan-mok's ``w_gate, w_up, w_down``). bf16 weights and activations on CUDA; fp32 on CPU (the
reference path's dtype there; ``--precision bf16`` then means the activations' dtype, as in MoEArgs).
Inputs N(0, 1), seeded per rank; ``--tokens`` per GPU.

Routing: ``balanced``: expert bias zero; ``skewed``: +0.05 on the expert bias of the first quarter
of the experts. Every implementation routes with that same bias: TorchTitan's ``expert_bias``
buffer exists when ``load_balance_coeff`` is set, which titan gets whenever the bias is used; a
model without a bias (Qwen3.5) gets one for the skew. ``load`` = picks of the busiest expert /
mean picks, from each implementation's own router: the routings side by side.

What TorchTitan's MoE cannot express is listed in the row's notes: sqrt(softplus) scores
(DeepSeek-V4; titan scores with sigmoid), SwiGLU clamps (DeepSeek-V4), the sigmoid-gated shared
expert and the auxiliary loss (Qwen3.5). Its router GEMM runs in the weights' dtype, titan-mok's in fp32.

Sections: ``layer`` = the module's forward (router, shared expert, routed experts, combine);
``routed`` = dispatch → experts → combine on fixed router outputs and a fixed shared output
(titan: TorchTitan's own ``MoE.forward`` with its router and shared experts replaced by those
fixed outputs; titan-mok: ``MoE.routed``).

Timing: forward under ``torch.no_grad``; backward = (forward + backward) − forward; median of
``--iters`` after ``--warmup`` (the two interleaved); CUDA events on GPU, the process's CPU time on
CPU (titan_mok/bench/timing.py says why); max over ranks.
Peak memory: ``torch.cuda.max_memory_allocated`` from after the build to the row's end (weights
included), max over ranks; n/a on CPU.

TFLOP/s per GPU (MoK's convention): layer forward F = 6·(T + T·K)·H·I (T tokens per GPU, the
shared expert counted as one expert of size I), backward 2F; routed section F = 6·T·K·H·I.

Roofline floor: forward max(F / C, W / B), backward max(2F / C, (W + Wg) / B). W = bytes of the
expert weights this GPU holds (its routed experts in bf16, or MXFP8 at 1 + 1/32 bytes per element;
the layer adds the bf16 shared expert; fp32 on CPU), Wg = their gradients (same dtype); C = dense
bf16 matmul ceiling, B = HBM bandwidth. ``--ceilings measured`` (default): C from an 8192³ bf16
matmul, B from a 1 GiB device copy ((read + written bytes) / time), both in this run (on CPU: fp32,
1024³ and 64 MiB);
``--ceilings h200``: C = 800 TFLOP/s, B = 4343 GB/s (measured on an H200, 2026-11-30).
floor = floor time / measured time (1: at the floor); × titan = titan's bf16 time / this time
(> 1: faster than TorchTitan's own layer), same shape and routing, this run.

A configuration that fails prints ``FAILED`` (or ``OOM``) with the exception and the process exits
1 after the others ran. ``--json PATH`` appends one JSON line per row (rank 0).
"""

import argparse
import dataclasses
import datetime
import gc
import json
import os
import sys
import zlib
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module
from torchtitan.distributed.expert_parallel import ExpertParallel
from torchtitan.models.moe.moe import MoE as TitanMoE
from torchtitan.models.moe.moe import MoEArgs as TitanMoEArgs
from torchtitan.tools.utils import has_cuda_capability

from titan_mok.bench.timing import max_over_ranks, median_ms, medians_ms
from titan_mok.moe import MoE
from titan_mok.moe.args import MoEArgs
from titan_mok.moe.expert_parallel import MokExpertParallel
from titan_mok.registry import MODELS, flavors

# Legend: T tokens per GPU, K top-k, H hidden, I expert FFN size, E experts.

# TorchTitan's parameter names → titan-mok's (the seed of each parameter's values).
_TITAN_TO_MOK = {
    "experts.w1": "experts.w_gate", "experts.w3": "experts.w_up", "experts.w2": "experts.w_down",
    "shared_experts.w1.weight": "shared_expert.w_gate.weight",
    "shared_experts.w3.weight": "shared_expert.w_up.weight",
    "shared_experts.w2.weight": "shared_expert.w_down.weight",
}
SKEW_BIAS = 0.05


def _materialize(make, device: torch.device, dtype: torch.dtype, names: dict) -> nn.Module:
    """``make()`` built on meta in ``dtype`` (buffers keep their own), then on ``device``: parameters
    seeded by name (``names`` maps a module name to its titan-mok name), buffers zero."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            module = make()
    finally:
        torch.set_default_dtype(default)
    module = module.to_empty(device=device)
    with torch.no_grad():
        for name, param in module.named_parameters():
            seed = zlib.crc32(names.get(name, name).encode())
            param.normal_(0.0, 0.02, generator=torch.Generator(device=device).manual_seed(seed))
        for buffer in module.buffers():
            buffer.zero_()
    return module


def _set_bias(expert_bias_E: torch.Tensor, skewed: bool) -> None:
    if skewed:  # a quarter of the experts get most of the picks
        with torch.no_grad():
            expert_bias_E[: expert_bias_E.shape[0] // 4] += SKEW_BIAS


def build_titan(args: MoEArgs, dim, precision, skewed, device, dtype, ep_mesh) -> tuple[nn.Module, list[str]]:
    """TorchTitan 0.2.2's own MoE at the shape of ``args``, and what it could not match."""
    if args.shared_expert_dim % args.expert_dim:
        raise ValueError(f"TorchTitan's shared experts are multiples of expert_dim = {args.expert_dim}; "
                         f"shared_expert_dim = {args.shared_expert_dim} is not")
    notes, score_func = [], args.score_func
    if score_func not in ("sigmoid", "softmax"):
        notes.append(f"{score_func} scores → sigmoid")
        score_func = "sigmoid"
    for unmatched, note in ((args.swiglu_limit, "no routed SwiGLU clamp"),
                            (args.shared_expert_swiglu_limit, "no shared SwiGLU clamp"),
                            (args.shared_expert_gate, "shared expert ungated"), (args.aux_loss_coef, "no aux loss")):
        if unmatched:
            notes.append(note)
    use_bias = args.use_expert_bias or skewed
    if skewed and not args.use_expert_bias:
        notes.append("expert bias added for the skew")
    tt_args = TitanMoEArgs(
        num_experts=args.num_experts, num_shared_experts=args.shared_expert_dim // args.expert_dim,
        score_func=score_func, route_norm=args.route_norm, route_scale=args.route_scale,
        score_before_experts=False,  # as every TorchTitan MoE flavor: scores weight the outputs
        top_k=args.top_k, num_expert_groups=args.num_expert_groups, num_limited_groups=args.num_limited_groups,
        # as TorchTitan's DeepSeek-V3 decides: torch._grouped_mm on SM90+, its for-loop elsewhere
        use_grouped_mm=device.type == "cuda" and has_cuda_capability(9, 0),
        load_balance_coeff=(args.load_balance_coeff or 1e-3) if use_bias else None,
    )
    moe = _materialize(lambda: TitanMoE(tt_args, dim, args.expert_dim), device, dtype, _TITAN_TO_MOK)
    if use_bias:
        _set_bias(moe.expert_bias, skewed)
    if ep_mesh is not None:
        parallelize_module(moe.experts, ep_mesh, ExpertParallel())
    return moe, notes


def build_mok(args: MoEArgs, dim, precision, skewed, device, dtype, ep_mesh, *, backend, kernels):
    """titan-mok's MoE with this backend and kernels, and what differs from the model."""
    notes, overrides = [], dict(backend=backend, kernels=kernels, precision=precision, hash_routing=False)
    if backend == "torchtitan" and args.swiglu_limit is not None:
        overrides["swiglu_limit"] = None  # TorchTitanExperts would run the reference FFN for the clamp
        notes.append("routed SwiGLU clamp dropped")
    if skewed and not args.use_expert_bias:
        overrides["use_expert_bias"] = True
        notes.append("expert bias added for the skew")
    moe_args = dataclasses.replace(args, **overrides)
    moe = _materialize(lambda: MoE(moe_args, dim), device, dtype, {})
    _set_bias(moe.expert_bias, skewed)
    if ep_mesh is not None:
        parallelize_module(moe.experts, ep_mesh, MokExpertParallel() if backend == "mok" else ExpertParallel())
        moe.experts.ep_mesh = ep_mesh
    return moe, notes


class _Fixed(nn.Module):
    """Stands in for a submodule: returns the same precomputed outputs on every call."""

    def __init__(self, outputs, top_k: int | None = None):
        super().__init__()
        self.outputs, self.top_k = outputs, top_k

    def forward(self, *args):
        return self.outputs


def routed_titan(moe: TitanMoE, x_BSH: torch.Tensor):
    """(run, leaves): TorchTitan's MoE.forward past its router and shared experts (replaced in
    ``moe`` by their outputs on x), returning y_TH; leaves are the inputs that get gradients."""
    x_TH = x_BSH[0].detach()
    with torch.no_grad():
        top_scores_TK, topk_idx_TK, counts_E = moe.router(x_TH, moe.expert_bias)
        if moe.shared_experts is not None:
            moe.shared_experts = _Fixed(moe.shared_experts(x_TH))
    top_scores_TK.requires_grad_()
    moe.router = _Fixed((top_scores_TK, topk_idx_TK, counts_E), top_k=moe.router.top_k)
    x_BSH = x_BSH.detach().clone().requires_grad_()
    return (lambda: moe(x_BSH)[0]), (x_BSH, top_scores_TK)


def routed_mok(moe: MoE, x_BSH: torch.Tensor):
    """(run, leaves): titan-mok's MoE.routed on its router's and shared expert's outputs on x."""
    x_TH = x_BSH[0].detach()
    with torch.no_grad():
        bias_E = moe.expert_bias if moe.args.use_expert_bias else None
        weights_TK, topk_idx_TK, _ = moe.router(moe.router.logits(x_TH), bias_E, None)
        shared_TH = moe.shared_expert(x_TH) if moe.shared_expert is not None else None
    x_TH, weights_TK, group = x_TH.clone().requires_grad_(), weights_TK.requires_grad_(), moe._ep_group()
    return (lambda: moe.routed(x_TH, weights_TK, topk_idx_TK, shared_TH, group, x_TH.dtype)), (x_TH, weights_TK)


@dataclass(frozen=True)
class Impl:
    help: str
    build: object
    """(MoEArgs, dim, precision, skewed, device, dtype, ep_mesh) → (module, notes)"""
    routed: object
    """(module, x_BSH) → (run → y_TH, leaves)"""
    precisions: tuple = ("bf16", "mxfp8")


IMPLS = {
    "titan": Impl("TorchTitan 0.2.2's own MoE (TokenChoiceTopKRouter, shared experts, GroupedExperts with "
                  "torch._grouped_mm on SM90+; its ExpertParallel under EP): the baseline",
                  build_titan, routed_titan, ("bf16",)),
    "reference": Impl("titan-mok MoE, backend mok, kernels reference (pure PyTorch)",
                      partial(build_mok, backend="mok", kernels="reference"), routed_mok),
    "auto": Impl("titan-mok MoE, backend mok, kernels auto (the fused path on SM90+ CUDA, else the reference)",
                 partial(build_mok, backend="mok", kernels="auto"), routed_mok),
    "triton": Impl("titan-mok MoE, backend mok, kernels triton (the fused path over symmetric memory; SM90+)",
                   partial(build_mok, backend="mok", kernels="triton"), routed_mok),
    "megakernel": Impl("titan-mok MoE, backend mok, kernels megakernel (the forward megakernel, one launch per "
                       "rank over symmetric memory under EP; its backward recomputes the triton forward, then as "
                       "triton; SM90+)",
                       partial(build_mok, backend="mok", kernels="megakernel"), routed_mok),
    "mok_tt": Impl("titan-mok router/shared/combine + TorchTitan grouped experts: the A/B where only the "
                   "routed path differs (titan-mok MoE, backend torchtitan)",
                   partial(build_mok, backend="torchtitan", kernels="auto"), routed_mok, ("bf16",)),
}


def measure_ceilings(device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """(dense matmul TFLOP/s, copy GB/s) on this device, the slowest rank's."""
    n, copy_bytes = (8192, 1 << 30) if device.type == "cuda" else (1024, 64 << 20)
    a_NN, b_NN = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    matmul_ms = max_over_ranks(median_ms(lambda: a_NN @ b_NN, 10, 3, device))
    src = torch.empty(copy_bytes // a_NN.element_size(), device=device, dtype=dtype)
    dst = torch.empty_like(src)
    copy_ms = max_over_ranks(median_ms(lambda: dst.copy_(src), 10, 3, device))
    del a_NN, b_NN, src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the rows' layers take the memory back
    return 2 * n**3 / matmul_ms / 1e9, 2 * copy_bytes / copy_ms / 1e6


def _fwd_bwd_ms(module, run, leaves, dy_TH, opts, device) -> tuple[float, float]:
    def forward():
        with torch.no_grad():
            run()

    def forward_backward():
        run().backward(dy_TH)
        module.zero_grad(set_to_none=True)
        for leaf in leaves:
            leaf.grad = None

    medians = medians_ms([forward, forward_backward], opts.iters, opts.warmup, device)  # interleaved
    fwd, fwd_bwd = (max_over_ranks(ms) for ms in medians)
    return fwd, fwd_bwd - fwd


def bench_row(row: dict, opts, device, dtype, ep_mesh, ceilings) -> dict:
    """Times one configuration; adds its measurements to ``row``."""
    ep, tokens = row["ep"], row["tokens_per_gpu"]
    flavor = flavors(row["shape"])[opts.flavor]
    args, dim = flavor.moe_args, flavor.dim
    module, row["notes"] = IMPLS[row["impl"]].build(args, dim, row["precision"], row["routing"] == "skewed",
                                                   device, dtype, ep_mesh)
    rank = dist.get_rank() if dist.is_initialized() else 0
    gen = torch.Generator(device=device).manual_seed(100 + rank)
    x_BSH = torch.randn(1, tokens, dim, device=device, dtype=dtype, generator=gen)
    dy_TH = torch.randn(tokens, dim, device=device, dtype=dtype, generator=gen)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    module.tokens_per_expert.zero_()
    with torch.no_grad():
        module(x_BSH)
    picks_E = module.tokens_per_expert.clone()
    if dist.is_initialized():
        dist.all_reduce(picks_E)
    row["load_max_over_mean"] = (picks_E.max() / picks_E.mean()).item()

    x_BSH.requires_grad_()
    row["layer_fwd_ms"], row["layer_bwd_ms"] = _fwd_bwd_ms(
        module, lambda: module(x_BSH)[0], (x_BSH,), dy_TH, opts, device)
    run, leaves = IMPLS[row["impl"]].routed(module, x_BSH)
    row["routed_fwd_ms"], row["routed_bwd_ms"] = _fwd_bwd_ms(module, run, leaves, dy_TH, opts, device)
    row["peak_mem_gib"] = (max_over_ranks(torch.cuda.max_memory_allocated(device)) / 2**30
                           if device.type == "cuda" else None)

    flops = {"layer": 6 * (tokens + tokens * args.top_k) * dim * args.expert_dim,
             "routed": 6 * tokens * args.top_k * dim * args.expert_dim}
    elem = dtype.itemsize  # bf16: 2 bytes (fp32 on CPU: 4)
    routed_elems = 3 * (args.num_experts // ep) * dim * args.expert_dim
    routed_bytes = routed_elems * (elem if row["precision"] == "bf16" else 1 + 1 / 32)
    shared_elems = 3 * dim * args.shared_expert_dim
    weights = {"layer": (routed_bytes + elem * shared_elems, elem * (routed_elems + shared_elems)),
               "routed": (routed_bytes, elem * routed_elems)}  # (read, gradients written)
    tflops, gbps = ceilings
    for section in ("layer", "routed"):
        read, grads = weights[section]
        floor_fwd = max(flops[section] / tflops / 1e9, read / gbps / 1e6)
        floor_bwd = max(2 * flops[section] / tflops / 1e9, (read + grads) / gbps / 1e6)
        for way, floor, flop in (("fwd", floor_fwd, flops[section]), ("bwd", floor_bwd, 2 * flops[section])):
            ms = row[f"{section}_{way}_ms"]
            row[f"{section}_{way}_tflops"] = flop / ms / 1e9
            row[f"{section}_{way}_floor_ms"] = floor
            row[f"{section}_{way}_floor_frac"] = floor / ms
    return row


def _fmt(value) -> str:
    """3 significant digits (CPU runs are orders of magnitude below GPU ones)."""
    return "—" if value is None else f"{value:.3g}"


def table(rows: list[dict]) -> str:
    head = ("| shape | routing | prec | impl | EP | layer fwd ms | layer bwd ms | routed fwd ms | routed bwd ms "
            "| layer TF/s f/b | × titan layer f/b | × titan routed f/b | floor layer f/b | floor routed f/b "
            "| peak GiB | load | notes |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        cells = [r["shape"], r["routing"], r["precision"], r["impl"], str(r["ep"])]
        if r["status"] != "ok":
            lines.append("| " + " | ".join(cells + [r["status"]] + [""] * 10 + [r["error"]]) + " |")
            continue
        cells += [_fmt(r[k]) for k in ("layer_fwd_ms", "layer_bwd_ms", "routed_fwd_ms", "routed_bwd_ms")]
        for key in ("layer_{}_tflops", "layer_{}_x_titan", "routed_{}_x_titan", "layer_{}_floor_frac",
                    "routed_{}_floor_frac"):
            cells.append(f"{_fmt(r.get(key.format('fwd')))} / {_fmt(r.get(key.format('bwd')))}")
        cells += ["n/a" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.1f}",
                  f"{r['load_max_over_mean']:.2f}", "; ".join(r["notes"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _comma_list(value: str, allowed, flag: str) -> list[str]:
    items = [item for item in value.split(",") if item]
    unknown = [item for item in items if item not in allowed]
    if unknown or not items:
        raise SystemExit(f"{flag} {value!r}: unknown {unknown}; choose a comma list of {list(allowed)}")
    return items


def parse_args(argv=None) -> argparse.Namespace:
    impls = "\n".join(f"  {name:10s} {impl.help}" for name, impl in IMPLS.items())
    formatter = type("Formatter", (argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter), {})
    parser = argparse.ArgumentParser(prog="python -m titan_mok.bench.layer", description=__doc__,
                                     formatter_class=formatter,
                                     epilog=f"implementations (--impl):\n{impls}")
    parser.add_argument("--impl", default="titan,auto,triton", help=f"comma list of {list(IMPLS)} (listed below)")
    parser.add_argument("--shape", default=",".join(MODELS), help=f"comma list of {list(MODELS)}")
    parser.add_argument("--flavor", default="full", help="the models' flavor whose MoE arguments set the shape")
    parser.add_argument("--precision", default="bf16", help="comma list of bf16, mxfp8 (routed experts)")
    parser.add_argument("--routing", default="balanced", help="comma list of balanced, skewed")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per GPU")
    parser.add_argument("--iters", type=int, default=30, help="timed calls per median")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls first")
    parser.add_argument("--ceilings", default="measured", choices=("measured", "h200"), help="roofline ceilings")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"),
                        help="where the layer runs: cuda if this machine has one")
    parser.add_argument("--json", default=None, metavar="PATH", help="append one JSON line per row (rank 0)")
    opts = parser.parse_args(argv)
    opts.impl = _comma_list(opts.impl, IMPLS, "--impl")
    opts.shape = _comma_list(opts.shape, MODELS, "--shape")
    opts.precision = _comma_list(opts.precision, ("bf16", "mxfp8"), "--precision")
    opts.routing = _comma_list(opts.routing, ("balanced", "skewed"), "--routing")
    for shape in opts.shape:
        if opts.flavor not in flavors(shape):
            raise SystemExit(f"--flavor {opts.flavor!r}: {shape} has {list(flavors(shape))}")
    for flag in ("tokens", "iters"):
        if getattr(opts, flag) < 1:
            raise SystemExit(f"--{flag} = {getattr(opts, flag)} must be >= 1")
    if opts.warmup < 0:
        raise SystemExit(f"--warmup = {opts.warmup} must be >= 0")
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: this machine has no CUDA device; use --device cpu")
    return opts


def main(argv=None) -> int:
    opts = parse_args(argv)
    gc.freeze()  # the imports' objects: the collections between rows then scan only what the rows made
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device(opts.device)
    ep_mesh = None
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not torch.cuda.is_available():
        from titan_mok import cpu_compat

        cpu_compat.apply()  # TorchTitan's MoE on CPU tensors (its pick counts, its EP permutation)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None,
                                timeout=datetime.timedelta(seconds=300))
        ep_mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("ep",))
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if opts.ceilings == "measured":
        ceilings = measure_ceilings(device, dtype)
        source = ("bf16 8192³ matmul, 1 GiB device copy" if device.type == "cuda"
                  else "fp32 1024³ matmul, 64 MiB copy") + ", this run"
    else:
        ceilings, source = (800.0, 4343.0), "H200 as measured 2026-11-30"
    if rank0:
        print(f"ceilings: {ceilings[0]:.1f} TFLOP/s, {ceilings[1]:.0f} GB/s ({source}); floor fwd = max(F/C, W/B), "
              f"bwd = max(2F/C, (W + Wg)/B)", flush=True)
    rows, failed = [], 0
    base = {"flavor": opts.flavor, "ep": world, "tokens_per_gpu": opts.tokens, "dtype": str(dtype).split(".")[1],
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "timer": "cuda events" if device.type == "cuda" else "process cpu time", "iters": opts.iters,
            "warmup": opts.warmup, "ceilings": opts.ceilings, "ceiling_tflops": ceilings[0],
            "ceiling_gbps": ceilings[1]}
    titan_ms = {}
    for shape in opts.shape:
        for routing in opts.routing:
            for impl in sorted(opts.impl, key=lambda name: name != "titan"):  # titan first: others divide by it
                for precision in opts.precision:
                    row = dict(base, shape=shape, routing=routing, precision=precision, impl=impl)
                    label = f"{shape} {routing} {precision} {impl}"
                    if precision not in IMPLS[impl].precisions:
                        if rank0:
                            print(f"SKIPPED {label}: {impl} runs {'/'.join(IMPLS[impl].precisions)} only", flush=True)
                        continue
                    try:
                        row = bench_row(row, opts, device, dtype, ep_mesh, ceilings)
                        row["status"] = "ok"
                    except torch.OutOfMemoryError as err:
                        failed += 1
                        row.update(status="OOM", error=f"out of memory: {str(err).splitlines()[0]}")
                    except Exception as err:  # noqa: BLE001 - reported per row, and the exit status says so
                        failed += 1
                        row.update(status="FAILED", error=f"{type(err).__name__}: {err}")
                    gc.collect()  # the failed row's layer before the next one is built
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    if row["status"] != "ok":
                        print(f"{row['status']} {label}{f' (rank {dist.get_rank()})' if world > 1 else ''}: "
                              f"{row['error']}", flush=True)
                    else:
                        if impl == "titan":
                            titan_ms[shape, routing] = row
                        titan = titan_ms.get((shape, routing))
                        for key in ("layer_fwd", "layer_bwd", "routed_fwd", "routed_bwd"):
                            row[f"{key}_x_titan"] = titan[f"{key}_ms"] / row[f"{key}_ms"] if titan else None
                        if rank0:
                            print(f"{label} ep={world}: layer {row['layer_fwd_ms']:.3f} / {row['layer_bwd_ms']:.3f} "
                                  f"ms, routed {row['routed_fwd_ms']:.3f} / {row['routed_bwd_ms']:.3f} ms", flush=True)
                    rows.append(row)
                    if rank0 and opts.json:
                        with open(opts.json, "a") as f:
                            f.write(json.dumps(row) + "\n")
    if rank0:
        print(f"\nMoE layer, {opts.tokens} tokens/GPU, EP {world}, {base['device']}, {base['dtype']}; ms (median of "
              f"{opts.iters}, max over ranks); × titan = titan bf16 ms / this ms; floor = roofline floor / this ms "
              f"(C = {ceilings[0]:.1f} TFLOP/s, B = {ceilings[1]:.0f} GB/s); load = busiest expert's picks / mean\n")
        print(table(rows), flush=True)
    if dist.is_initialized():
        dist.barrier()  # every rank done with the group (rank 0 prints meanwhile) before any tears it down
        dist.destroy_process_group()
    if failed:
        print(f"{failed} configuration(s) failed or ran out of memory", file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
