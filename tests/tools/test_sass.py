"""The offline sm_90 report (benchmarks.tools.sass): the kernels of an MXFP8 pass compiled on a
CPU-only machine, the two-programs-per-SM promise of the register-capped few-rows configs kept, the
many-rows configs free of spills, the H100's cooperative forward kernels (Gluon: no interpreter runs them, so
this is where CI compiles them), and the weight gradient's kernel choice."""

import functools
import json
import os
import subprocess
import sys

import pytest
import torch

from benchmarks.tools import sass
from tests.torchrun import REPO
from titan_mok.kernels import tile_configs as tc

pytestmark = pytest.mark.skipif(
    not all(os.path.exists(os.path.join(sass._TOOLS, t)) for t in ("ptxas", "nvdisasm", "cuobjdump")),
    reason="Triton's wheel has no ptxas/nvdisasm/cuobjdump here")


@functools.cache
def _report(*args):
    """The tool's JSON, run without the interpreter (tests set TRITON_INTERPRET=1 before any kernel
    is defined, and interpreted kernels cannot be compiled). Run once per arguments: a compile gives the same
    report every time, and two tests read the one at 40 rows per expert on the default chip."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "benchmarks.tools.sass", "--json", *args], env=env,
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_few_rows_kernels_fit_their_programs_per_sm():
    """At 40 rows per expert (Qwen3.5, EP=1) every MXFP8 kind compiles on the warp-specialized kernel with its
    "@few_rows" config; a config that caps the registers (maxnreg) so that two programs share an SM must fit
    two, the others one."""
    kinds = {"fwd: gate/up + SwiGLU": "swiglu", "fwd: down": "plain", "dgrad: down + SwiGLU bwd": "swiglu_bwd",
             "dgrad: gate/up (dual)": "dual"}
    ws = {r["step"]: r for r in _report("--shape", "qwen", "--rows-per-expert", "40")
          if r["kernel"] == "_grouped_mm_mx_ws_kernel"}
    assert sorted(ws) == sorted(kinds)
    for step, r in ws.items():
        assert r["opcodes"].get("HGMMA", 0) > 0, f"{step}: no wgmma in the SASS"
        want = 2 if tc.H200.mm[f"mxfp8/{kinds[step]}@few_rows"].cuda.maxnreg else 1
        assert r["programs_per_sm"] == want, f"{step}: {r['programs_per_sm']} programs per SM, want {want}: {r}"


def test_many_rows_kernels_do_not_spill():
    """At 2048 rows per expert (the many-rows tier) the MXFP8 plain and dual kinds compile their
    "@many_rows" configs (256-token tiles, their consumers' register count) with no spill stack."""
    ws = {r["step"]: r for r in _report("--shape", "qwen", "--rows-per-expert", "2048")
          if r["kernel"] == "_grouped_mm_mx_ws_kernel"}
    for step, kind in (("fwd: down", "plain"), ("dgrad: gate/up (dual)", "dual")):
        cfg = tc.H200.mm[f"mxfp8/{kind}@many_rows"].cuda
        assert cfg.CONSUMER_REGS in ws[step]["setmaxnreg"], f"{step}: not its many-rows config: {ws[step]}"
        assert ws[step]["stack_bytes"] == 0, f"{step}: {ws[step]['stack_bytes']} bytes of spill stack"


def test_h100_forward_at_many_rows_compiles_the_cooperative_kernel():
    """On the H100 at 2048 rows per expert both forward GEMMs run grouped_mm_coop (its table's cooperative entries):
    they compile for sm_90, fit one program per SM, hand the consumers their registers, and store by TMA (each of
    the two consumer partitions' code one store per output: plain 1 output, SwiGLU 3)."""
    reports = _report("--shape", "qwen", "--rows-per-expert", "2048", "--precision", "bf16", "--chip",
                      "NVIDIA H100 80GB HBM3")
    coop = {r["step"]: r for r in reports if r["kernel"] == "_grouped_mm_coop_kernel"}
    assert sorted(coop) == ["fwd: down", "fwd: gate/up + SwiGLU"], sorted(coop)
    for step, kind, outputs in (("fwd: gate/up + SwiGLU", "swiglu", 3), ("fwd: down", "plain", 1)):
        r = coop[step]
        regs = tc.H100.mm[f"bf16/{kind}@many_rows"].cuda.CONSUMER_REGS
        assert r["programs_per_sm"] == 1 and regs in r["setmaxnreg"], f"{step}: {r}"
        assert r["opcodes"].get("UTMASTG", 0) == 2 * outputs, f"{step}: {r['opcodes'].get('UTMASTG', 0)} TMA stores"


@pytest.mark.parametrize("rows_per_expert, kernels", [(40, ["_grouped_wgrad_kernel", "_grouped_wgrad_ws_kernel"]),
                                                      (80, ["_grouped_wgrad_ws_kernel"])])
def test_weight_gradient_kernel_follows_rows_per_expert(rows_per_expert, kernels):
    """The weight gradients run the warp-specialized kernel from wgrad_ws rows per expert on (Qwen3.5
    EP=2: 80); below (EP=1: 40) the Triton kernel for w_gate's and w_up's, the warp-specialized one for w_down's
    (more features than K columns). The warp-specialized one with wgmmas, one program per SM, and at most the 8
    bytes of stack ptxas gives it since its loader waits before rewriting descriptors: one 64-bit value stored
    before the partitions start and loaded once at each one's entry, outside its work loop (the 48-register loader
    is one short)."""
    wgrads = [r for r in _report("--shape", "qwen", "--rows-per-expert", str(rows_per_expert), "--precision", "bf16")
              if r["step"] == "wgrad"]
    assert [r["kernel"] for r in wgrads] == kernels, wgrads
    r = wgrads[-1]
    assert r["opcodes"].get("HGMMA", 0) > 0 and r["stack_bytes"] <= 8 and r["programs_per_sm"] == 1, r


def test_set_compiles_the_variant_and_names_a_bad_key():
    """--set compiles a config variant (config_ab's syntax): the down projection's consumers ask for the variant's
    registers, the other kinds keep theirs; a key that is no config entry is refused by name."""
    regs = tc.H200.mm["mxfp8/plain@mid_rows"].cuda.CONSUMER_REGS - 32
    ws = {r["step"]: r for r in _report("--shape", "qwen", "--rows-per-expert", "80", "--set",
                                        f'mxfp8/plain@mid_rows={{"CONSUMER_REGS": {regs}}}')
          if r["kernel"] == "_grouped_mm_mx_ws_kernel"}
    assert regs in ws["fwd: down"]["setmaxnreg"], ws["fwd: down"]
    assert regs not in ws["dgrad: gate/up (dual)"]["setmaxnreg"], ws["dgrad: gate/up (dual)"]
    out = subprocess.run([sys.executable, "-m", "benchmarks.tools.sass", "--set", "mxfp8/nope={}"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 2 and "--set mxfp8/nope: not a config key" in out.stderr, out.stderr[-2000:]


def test_compiling_context_restores_what_it_replaced():
    """The stand-in driver, the compile-only launches, the SM count and the launchers' chip answer are undone on
    exit, even after an error inside."""
    def patched():
        return sass.JITFunction.run, sass.grouped_mm_ws.sm_count, torch.cuda.current_device, tc.chip_of

    before = patched()
    with pytest.raises(RuntimeError, match="inside"):
        with sass.compiling_for_sm90("NVIDIA H100 80GB HBM3"):
            assert sass.JITFunction.run is not before[0]
            assert tc.chip_of(torch.zeros(1)) == "NVIDIA H100 80GB HBM3"
            raise RuntimeError("inside")
    assert patched() == before


def test_chip_compiles_that_chips_configs():
    """--chip compiles the configs of a chip with a table of its own: on the H100, MXFP8 SwiGLU gate/up at few rows
    per expert (Qwen3.5 at EP=1) holds a third ring slot in shared memory; an unknown chip is refused."""
    h100 = "NVIDIA H100 80GB HBM3"
    shared = {chip: {r["step"]: r["shared_bytes"] for r in _report("--shape", "qwen", "--rows-per-expert", "40",
                                                                      *(["--chip", chip] if chip else []))
                     if r["kernel"] == "_grouped_mm_mx_ws_kernel"} for chip in ("", h100)}
    step = "fwd: gate/up + SwiGLU"
    assert shared[h100][step] > shared[""][step], shared
    out = subprocess.run([sys.executable, "-m", "benchmarks.tools.sass", "--chip", "NVIDIA B200"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 2 and "--chip: invalid choice" in out.stderr, out.stderr[-2000:]


def test_megakernel_variants_load_by_tma_without_spills_in_their_k_loops():
    """--megakernel: the forward megakernel at Kimi K2.7's sizes, bf16 and MXFP8 routed experts, on 64- and 128-row
    tiles, both loads: wgmmas in every variant; gemm = "tma" reads its operands by TMA (no cp.async copy left), "ptr"
    by cp.async; no spill load or store inside a K loop; one program per SM."""
    reports = {(r["precision"], r["gemm"], r["block_m"]): r for r in _report("--megakernel", "--block-m", "64", "128")}
    assert sorted(reports) == [(p, g, m) for p in ("bf16", "mxfp8") for g in ("ptr", "tma") for m in (64, 128)], \
        sorted(reports)
    for (precision, gemm, block_m), r in reports.items():
        ops = r["opcodes"]
        assert ops.get("HGMMA", 0) > 0 and r["k_loop_spills"] == 0 and r["programs_per_sm"] == 1, r
        if gemm == "tma":
            assert ops.get("UTMALDG", 0) > 0 and ops.get("LDGSTS", 0) == 0, (precision, gemm, block_m, ops)
        else:
            assert ops.get("UTMALDG", 0) == 0 and ops.get("LDGSTS", 0) > 0, (precision, gemm, block_m, ops)
