"""The GPU rows of docs/faults.md, on two GPUs (skipped elsewhere):
- a device-side wait that never completes: one rank enters the fused path's workspace barrier
  (``titan_mok.moe.workspace``, symmetric memory) and its peer never arrives; the waiting rank
  gets a device error within the barrier's bound instead of a hung GPU;
- NaN router logits on one EP rank with ``[mok] kernels = "triton"`` (the fused path checks no
  logits on the host): every rank stops with the non-finite step error, naming the step and the
  module where the NaN began (``titan_mok.faults``)."""

import datetime
import json
import os
import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests import torchrun

pytestmark = [pytest.mark.gpu, pytest.mark.two_gpus]
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
BOUND_MS = 3000
"""The barrier bound these tests set (titan-mok's is ``workspace.BARRIER_TIMEOUT_MS``, 60 s)."""
_SYMMETRIC_MEMORY_ENV = (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1"))


def _barrier_worker(rank: int, init_file: str, out_dir: str) -> None:
    from titan_mok.moe import workspace

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60), device_id=torch.device("cuda", rank))
    ws = workspace.get_workspace(dist.group.WORLD, 64, 2, 256, torch.bfloat16, torch.device("cuda", rank))
    ws.barrier()  # both arrive: the barrier works
    torch.cuda.synchronize()
    dist.barrier()
    workspace.BARRIER_TIMEOUT_MS = BOUND_MS
    result = {"error": None, "seconds": 0.0}
    if rank == 0:
        start = time.monotonic()
        try:
            ws.barrier()  # rank 1 never arrives
            torch.cuda.synchronize()
        except RuntimeError as e:
            result["error"] = str(e)
        result["seconds"] = time.monotonic() - start
    else:
        time.sleep(3 * BOUND_MS / 1000)
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # rank 0's CUDA context does not survive the device error


@needs_two_gpus
def test_device_wait_for_a_peer_that_never_arrives_is_bounded(tmp_path):
    for var, value in _SYMMETRIC_MEMORY_ENV:
        os.environ[var] = value
    mp.spawn(_barrier_worker, args=(str(tmp_path / "pg_init"), str(tmp_path)), nprocs=2, join=True)
    waiting = json.loads((tmp_path / "0.json").read_text())
    print(f"\nworkspace barrier without its peer: device error after {waiting['seconds']:.1f} s "
          f"(bound {BOUND_MS / 1000} s): {waiting['error']}")
    assert waiting["error"] is not None, "the barrier returned without its peer"
    assert BOUND_MS / 1000 * 0.5 <= waiting["seconds"] <= BOUND_MS / 1000 + 15


@needs_two_gpus
def test_router_nan_on_one_rank_stops_every_rank_on_the_triton_path(tmp_path):
    for var, value in _SYMMETRIC_MEMORY_ENV:
        os.environ[var] = value
    rc, output = torchrun.run(
        "titan_mok.train", "train_configs/kimi_k2_7_code/debug.toml", "--training.steps", "3",
        "--job.dump_folder", str(tmp_path / "run"), "--mok.kernels", "triton",
        "--debug.fault_nonfinite_step", "2", "--debug.fault_nonfinite_module", "layers.1.ffn_norm",
        "--debug.fault_nonfinite_rank", "1", check=False,
    )
    assert rc != 0
    for rank in (0, 1):
        assert re.search(rf"\[rank{rank}\]: titan_mok\.faults\.NonfiniteError: step 2: .*first non-finite forward "
                         r"output: 'layers\.1\.ffn_norm' on rank 1", output), output[-6000:]
