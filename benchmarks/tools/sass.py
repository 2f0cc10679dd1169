"""What ptxas makes of the grouped expert GEMMs for Hopper, without a GPU: registers, spill stack,
shared memory and SASS instruction mix of every kernel one MoE FFN pass would launch.

    python3 -m benchmarks.tools.sass [--shape kimi] [--rows-per-expert 43] [--precision mxfp8] [--sass-dir DIR] [--json]
    python3 -m benchmarks.tools.sass --rows-per-expert 85 --set 'mxfp8/plain@mid_rows={"CONSUMER_REGS": 200}'
    python3 -m benchmarks.tools.sass --megakernel [--shape kimi] [--block-m 64 128] [--gemm ptr tma] [--num-stages 4]
        [--shared-dim I_S] [--precision bf16] [--keep-rows | --dgrad]

Why: device time is scarce. A tile config that spills, or that cannot fit two programs on an SM,
shows here first. Triton's wheel carries ptxas, nvdisasm and
cuobjdump; a stand-in driver reports an sm_90 target, and every kernel the launchers would start
is compiled instead (``JITFunction.run`` with ``warmup=True``), so nothing runs and the tensors are
CPU tensors whose values do not matter. The launchers are told they run on CUDA, so they pick the
kernels and configs they would there (tile_configs.select: the Gluon kernel for MXFP8, the rows-per-expert
configs); ``--set``/``--unset`` compile a variant table instead, as ``config_ab`` would time it, so that its
registers, spills and shared memory show before any device time is spent; ``--chip`` the table of a chip with one
of its own (``tile_configs.TABLES``; default the H200's).
Registers and shared memory are per program; a warp-specialized kernel's partitions then move
registers among themselves (``setmaxnreg``, listed).
``--megakernel``: the forward MoK megakernel's concurrent launch instead (``kernels/mok_megakernel.py``), one kernel
per combination of routed-expert precision (``--precision``; default both), tile rows, GEMM loads and pipeline depth,
with its TMA loads (UTMALDG), cp.async copies (LDGSTS), wgmmas (HGMMA) and the spill loads/stores inside its K loops
(a spill elsewhere costs little). ``--keep-rows``: the training launch's, whose gate/up items also store g, u, h
for the backward (``KernelVariant.keep_rows``). ``--dgrad``: the backward's dgrad launch instead
(``kernels/mok_megakernel_bwd.py``; no shared expert).
"""

import argparse
import contextlib
import json
import os
import re
import subprocess
import tempfile
from collections import Counter

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import JITFunction

from benchmarks.tools.config_ab import add_variant_args, variant_table
from benchmarks.tools.grouped_ffn import SHAPES
from titan_mok.kernels import grouped_gemm as gg
from titan_mok.kernels import grouped_mm_ws
from titan_mok.kernels import tile_configs as tc
from titan_mok.kernels import mok_megakernel, mok_megakernel_bwd
from titan_mok.kernels.grouped_ffn import weight_operand
from titan_mok.moe.megakernel import MegakernelConfig

H200_SMS = 132
REGISTERS_PER_SM = 65536
SHARED_PER_SM = 228 * 1024  # bytes; one program may take up to 227 KB of it
_TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


class _Sm90Driver:
    """The few driver calls compiling needs, answered for an H100/H200 (compute capability 9.0)."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


@contextlib.contextmanager
def compiling_for_sm90(chip: str = ""):
    """Inside: every Triton/Gluon launch compiles for sm_90 as on a GPU named chip (its tile table: TABLES' or, for
    "" and any other name, the H200's) and launches nothing; yields the list that collects (kernel name, compiled
    kernel)."""
    compiled = []
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, kernel))
        return kernel

    replaced = grouped_mm_ws.sm_count, torch.cuda.current_device, tc.chip_of
    active = triton.runtime.driver._active  # None until a driver is used: reset_active() would need a GPU
    triton.runtime.driver.set_active(_Sm90Driver())
    JITFunction.run = compile_only
    grouped_mm_ws.sm_count = lambda device_index: H200_SMS  # persistent grids: one program per SM
    torch.cuda.current_device = lambda: 0
    tc.chip_of = lambda t: chip  # the launchers pick the kernels they would on that GPU
    try:
        yield compiled
    finally:
        JITFunction.run = run
        grouped_mm_ws.sm_count, torch.cuda.current_device, tc.chip_of = replaced
        triton.runtime.driver._active = active


def _tool(name: str, cubin: bytes, *flags: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([os.path.join(_TOOLS, name), *flags, f.name], capture_output=True, text=True,
                              check=True).stdout


def kernel_report(name: str, kernel) -> dict:
    """Registers per thread at launch, stack (spill) and shared bytes per program, warps, SASS opcode
    counts and setmaxnreg targets of a compiled kernel."""
    usage = _tool("cuobjdump", kernel.asm["cubin"], "-res-usage")
    sass = _tool("nvdisasm", kernel.asm["cubin"], "-c")
    opcodes = re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M)
    return {
        "kernel": name,
        "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
        "stack_bytes": int(re.search(r"STACK:(\d+)", usage).group(1)),
        "shared_bytes": kernel.metadata.shared,
        "warps": kernel.metadata.num_warps,
        "instructions": len(opcodes),
        "opcodes": Counter(op.split(".")[0] for op in opcodes),
        "setmaxnreg": sorted({int(v, 16) for v in re.findall(r"USETMAXREG\.\w+\.CTAPOOL (?:UP\d, )?0x([0-9a-f]+)", sass)}),
        "sass": sass,
    }


def k_loop_spills(sass: str) -> int:
    """Spill loads and stores (LDL, STL) inside the loops that hold wgmmas (the K loops). Loops are back edges; those
    from the stubs after the kernel's last EXIT (a barrier wait's slow path jumping back) are not loops."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"(\.L_x_\d+):", line.strip()))}
    last_exit = max((i for i, line in enumerate(lines) if re.search(r"^\s+/\*[0-9a-f]+\*/\s+EXIT ;", line)),
                    default=len(lines))
    spills = 0
    for i, line in enumerate(lines[:last_exit]):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i:
            body = lines[labels[m.group(1)]:i + 1]
            if any("HGMMA" in b for b in body):
                spills += sum(bool(re.search(r"\b(LDL|STL)\b", b)) for b in body)
    return spills


def megakernel_kernels(shape: str, block_ms, gemms, stages, shared_dim: int = 0,
                       precisions=("bf16",), keep_rows: bool = False, dgrad: bool = False) -> list[dict]:
    """The forward megakernel's concurrent launch compiled for each (precision, block_m, gemm, num_stages), at the
    shape's H and I, the default config's other sizes and 8 ranks' local experts; one report per variant. keep_rows:
    the training launch (it stores g, u, h). dgrad: the dgrad launch's instead."""
    if dgrad and (keep_rows or shared_dim):
        raise ValueError("the dgrad launch has no kept rows and no shared expert: drop --keep-rows and --shared-dim")
    name, compile_launch = (("_megakernel_bwd", mok_megakernel_bwd.compile_megakernel_bwd) if dgrad else
                            ("_megakernel", mok_megakernel.compile_megakernel))
    dim_h, dim_i, num_experts, _ = SHAPES[shape]
    reports = []
    for precision in precisions:
        for block_m in block_ms:
            for gemm in gemms:
                for num_stages in stages:
                    variant = mok_megakernel.KernelVariant(
                        dim_h, dim_i, shared_dim, num_experts // 8, block_m, MegakernelConfig.block_n,
                        MegakernelConfig.num_warps, num_stages, False, gemm=gemm, mx=precision == "mxfp8",
                        keep_rows=keep_rows)
                    with compiling_for_sm90():
                        kernel = compile_launch(variant)
                    report = kernel_report(name, kernel)
                    kind = " dgrad" if dgrad else " keep" if variant.keep_rows else ""
                    reports.append({"step": f"megakernel {precision}{kind} {gemm} M{block_m} S{num_stages}",
                                    "precision": precision, "block_m": block_m, "gemm": gemm,
                                    "num_stages": num_stages, "k_loop_spills": k_loop_spills(report["sass"]),
                                    **report})
    return reports


def programs_per_sm(report: dict) -> int:
    """Programs that fit on one SM by registers (allocated per warp in units of 256) and shared memory."""
    regs_per_warp = -(-report["registers"] * 32 // 256) * 256
    by_regs = REGISTERS_PER_SM // (regs_per_warp * report["warps"])
    by_shared = SHARED_PER_SM // (report["shared_bytes"] + 1024)  # 1 KB reserved per program
    return min(by_regs, by_shared)


def ffn_pass_kernels(shape: str, rows_per_expert: int, precision: str, num_experts: int = 2,
                     chip: str = "", table: tc.ChipTable | None = None) -> list[dict]:
    """Compile the grouped GEMMs (and MXFP8 quantizations) of one forward and backward of the routed
    experts at this many rows per expert, as CUDA on chip would launch them (reading table; None: the chip's); one
    report per kernel."""
    dim_h, dim_i, _, _ = SHAPES[shape]
    rows = rows_per_expert * num_experts
    bf16 = dict(dtype=torch.bfloat16)
    x, dy = torch.zeros(rows, dim_h, **bf16), torch.zeros(rows, dim_h, **bf16)
    g, u, h, dg, du = (torch.zeros(rows, dim_i, **bf16) for _ in range(5))
    w_gate, w_up = torch.zeros(num_experts, dim_i, dim_h, **bf16), torch.zeros(num_experts, dim_i, dim_h, **bf16)
    w_down = torch.zeros(num_experts, dim_h, dim_i, **bf16)
    group_end = torch.arange(1, num_experts + 1, dtype=torch.int32) * rows_per_expert

    weights = {"w_gate": w_gate, "w_up": w_up, "w_down": w_down}
    reports, seen = [], set()
    with compiling_for_sm90(chip) as compiled:

        def step(label, launches):  # run launches(), report the kernels it compiled
            first = len(compiled)
            result = launches()
            for name, kernel in compiled[first:]:
                if id(kernel) not in seen:  # a kernel compiled by an earlier step
                    seen.add(id(kernel))
                    reports.append({"step": label, **kernel_report(name, kernel)})
            return result

        fwd = step("weights: forward layout",
                   lambda: {n: weight_operand(w, precision, 2, n) for n, w in weights.items()})
        bwd = step("weights: dgrad layout",
                   lambda: {n: weight_operand(w, precision, 1, n) for n, w in weights.items()})
        t = dict(table=table)
        step("fwd: gate/up + SwiGLU",
             lambda: gg.grouped_gate_up_swiglu(x, group_end, fwd["w_gate"], fwd["w_up"], None, **t))
        step("fwd: down", lambda: gg.grouped_mm(h, group_end, fwd["w_down"], **t))
        step("dgrad: down + SwiGLU bwd",
             lambda: gg.grouped_down_dgrad_swiglu(dy, group_end, bwd["w_down"], g, u, None, **t))
        step("dgrad: gate/up (dual)", lambda: gg.grouped_mm_sum(dg, du, group_end, bwd["w_gate"], bwd["w_up"], **t))
        step("wgrad", lambda: [gg.grouped_wgrad(a, b, group_end, precision, **t) for a, b in ((dg, x), (dy, h))])
    return reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="kimi", choices=sorted(SHAPES))
    parser.add_argument("--rows-per-expert", type=int, default=43, help="43: Kimi at EP=1, 2048 tokens/GPU")
    parser.add_argument("--precision", choices=("bf16", "mxfp8"),
                        help="default: mxfp8; --megakernel: the routed experts' (default: both)")
    parser.add_argument("--sass-dir", help="also write each kernel's SASS here")
    parser.add_argument("--json", action="store_true", help="print the reports as JSON (no SASS text)")
    parser.add_argument("--chip", default="", choices=["", *tc.TABLES],
                        help="the tile table of a chip with one of its own (default: the H200's)")
    add_variant_args(parser)
    parser.add_argument("--megakernel", action="store_true",
                        help="compile the forward megakernel's variants instead (--block-m, --gemm, --num-stages)")
    parser.add_argument("--block-m", type=int, nargs="+", default=[64, 128], help="--megakernel: rows per tile")
    parser.add_argument("--gemm", nargs="+", default=list(mok_megakernel.GEMM_LOADS),
                        choices=mok_megakernel.GEMM_LOADS, help="--megakernel: the item GEMMs' loads")
    parser.add_argument("--num-stages", type=int, nargs="+", default=[MegakernelConfig.num_stages],
                        help="--megakernel: K-loop pipeline depths")
    parser.add_argument("--shared-dim", type=int, default=0, help="--megakernel: I_S of a shared expert (0: none)")
    parser.add_argument("--keep-rows", action="store_true",
                        help="--megakernel: the training launch, which also stores g, u, h for the backward")
    parser.add_argument("--dgrad", action="store_true", help="--megakernel: the backward's dgrad launch instead")
    opts = parser.parse_args()
    try:
        table = variant_table(tc.table_for(opts.chip), opts.sets, opts.unsets)
    except ValueError as e:
        parser.error(str(e))
    if opts.rows_per_expert < 1:
        parser.error(f"--rows-per-expert must be >= 1, got {opts.rows_per_expert}")
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        parser.error("TRITON_INTERPRET=1 interprets the kernels instead of compiling them: unset it")
    if opts.megakernel:
        megakernel_main(opts)
        return
    reports = ffn_pass_kernels(opts.shape, opts.rows_per_expert, opts.precision or "mxfp8", chip=opts.chip,
                               table=table)
    if opts.json:
        print(json.dumps([{**{k: v for k, v in r.items() if k != "sass"}, "programs_per_sm": programs_per_sm(r)}
                          for r in reports]))
        return
    print(f"{'step':26} {'kernel':30} {'regs':>4} {'stack':>5} {'shared':>7} {'warps':>5} {'per SM':>6} "
          f"{'instr':>6} {'GMMA':>5}  setmaxnreg")
    for i, r in enumerate(reports):
        gmma = r["opcodes"]["HGMMA"] + r["opcodes"]["QGMMA"]  # bf16 and E4M3 wgmmas
        print(f"{r['step']:26} {r['kernel']:30} {r['registers']:4} {r['stack_bytes']:5} {r['shared_bytes']:7} "
              f"{r['warps']:5} {programs_per_sm(r):6} {r['instructions']:6} {gmma:5}  {r['setmaxnreg'] or '-'}")
        if opts.sass_dir:
            os.makedirs(opts.sass_dir, exist_ok=True)
            with open(os.path.join(opts.sass_dir, f"{i:02d}_{r['kernel']}.sass"), "w") as f:
                f.write(r["sass"])


def megakernel_main(opts) -> None:
    precisions = (opts.precision,) if opts.precision else ("bf16", "mxfp8")
    try:
        reports = megakernel_kernels(opts.shape, opts.block_m, opts.gemm, opts.num_stages, opts.shared_dim,
                                     precisions, opts.keep_rows, opts.dgrad)
    except ValueError as e:
        raise SystemExit(f"sass: {e}")
    if opts.json:
        print(json.dumps([{**{k: v for k, v in r.items() if k != "sass"}, "programs_per_sm": programs_per_sm(r)}
                          for r in reports]))
        return
    print(f"{'variant':34} {'regs':>4} {'stack':>5} {'K-loop spills':>13} {'shared':>7} {'per SM':>6} {'instr':>6} "
          f"{'HGMMA':>5} {'UTMALDG':>7} {'LDGSTS':>6}")
    for i, r in enumerate(reports):
        ops = r["opcodes"]
        print(f"{r['step']:34} {r['registers']:4} {r['stack_bytes']:5} {r['k_loop_spills']:13} {r['shared_bytes']:7} "
              f"{programs_per_sm(r):6} {r['instructions']:6} {ops['HGMMA']:5} {ops['UTMALDG']:7} {ops['LDGSTS']:6}")
        if opts.sass_dir:
            os.makedirs(opts.sass_dir, exist_ok=True)
            with open(os.path.join(opts.sass_dir, f"{i:02d}_megakernel_{r['precision']}_{r['gemm']}_m{r['block_m']}_s{r['num_stages']}.sass"), "w") as f:
                f.write(r["sass"])


if __name__ == "__main__":
    main()
