"""The mok expert-parallel strategy: experts as DTensors ``Shard(0)`` on the ep mesh.

Legend: E experts, L = E / ep local experts, I expert FFN size, H hidden.

TorchTitan's ExpertParallel hooks the experts module's inputs and outputs
(all-to-all around a grouped GEMM). In titan-mok the MoE layer itself runs the
schedule → dispatch → experts → combine (``titan_mok.moe.dispatch``), because
dispatch needs the top-k ids and combine the weights and the shared output;
so this style only shards the weights and hands the layer its ep mesh.
"""

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from titan_mok.moe.experts import RoutedExperts


class MokExpertParallel(ParallelStyle):
    """Apply with ``parallelize_module(moe.experts, ep_mesh, MokExpertParallel())``."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, RoutedExperts):
            raise TypeError(f"MokExpertParallel applies to titan_mok RoutedExperts, got {type(module).__name__}")
        if device_mesh.ndim != 1:
            raise ValueError(f"MokExpertParallel needs the 1-D ep mesh, got a {device_mesh.ndim}-D mesh")
        ep_degree = device_mesh.size()
        if module.num_experts % ep_degree:
            raise ValueError(
                f"expert_parallel_degree = {ep_degree} must divide the number of experts ({module.num_experts})"
            )
        for name, param in module.named_parameters(recurse=False):
            # w_gate/w_up [E, I, H], w_down [E, H, I] → [L, ...] per ep rank
            module.register_parameter(name, nn.Parameter(distribute_tensor(param, device_mesh, [Shard(0)])))
        module.ep_mesh = device_mesh
        return module
