"""Pins each CPU adaptation in titan_mok.cpu_compat: every test here fails once
torch or TorchTitan no longer needs the adaptation (then delete it)."""

import pytest
import torch
import torch.distributed as dist

import torchtitan.tools.utils as tt_utils

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="pins CPU-only behaviour")


def test_torchtitan_falls_back_to_cuda_without_accelerator():
    assert tt_utils.get_device_info()[0] == "cuda"


@pytest.mark.parametrize("name", ["get_device_name", "get_device_properties", "memory_stats", "reset_peak_memory_stats"])
def test_torch_cpu_lacks_device_module_function(name):
    assert not hasattr(torch.cpu, name)


def test_torch_cpu_current_device_is_not_an_int():
    assert not isinstance(torch.cpu.current_device(), int)


def test_torchtitan_permute_kernel_is_triton_by_default():
    import inspect

    from torchtitan.models.moe.kernels import generate_permute_indices

    assert inspect.signature(generate_permute_indices).parameters["use_cpu"].default is False


def test_gloo_has_no_premul_sum(one_rank_gloo):
    with pytest.raises((RuntimeError, ValueError)):
        dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(0.5))


def test_device_module_shim_answers_what_torchtitan_asks():
    from titan_mok.cpu_compat import CpuDeviceModule

    cpu = CpuDeviceModule()
    assert cpu.current_device() == 0
    assert cpu.get_device_properties().total_memory > 0
    assert cpu.memory_stats()["active_bytes.all.peak"] > 0
    assert isinstance(cpu.get_device_name(), str)


def test_torch_cpu_histc_lacks_int64():
    with pytest.raises(NotImplementedError):
        torch.histc(torch.tensor([0, 1, 1]), bins=2, min=0, max=2)


def test_histc_shim_counts_int_ids_like_cuda():
    from titan_mok.cpu_compat import TorchWithCpuIntHistc

    ids = torch.tensor([3, 0, 3, 1, 3])
    counts = TorchWithCpuIntHistc().histc(ids, bins=5, min=0, max=5)
    assert counts.dtype == torch.int64 and counts.tolist() == [1, 1, 0, 3, 0]
    assert TorchWithCpuIntHistc().float32 is torch.float32
