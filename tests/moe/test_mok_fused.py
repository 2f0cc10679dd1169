"""The fused mok path's kernels and autograd functions against the reference backend.

On CPU the Triton kernels run in the interpreter (small sizes); several EP ranks are simulated
in one process by handing the kernels tables of the "ranks'" buffer addresses, exactly as the
symmetric-memory peer pointers are handed to them on the GPU. Determinism and equality with the
reference are compared bit for bit (torch.equal). GPU and 2-process tests: test_mok_fused_gpu.py.
"""

import pytest
import torch

from titan_mok.kernels.mok_combine import ref_slot_reduce, ref_slot_scale, slot_reduce, slot_scale
from titan_mok.kernels.mok_rows import move_rows, ref_pull_rows, ref_push_rows
from titan_mok.kernels.mok_schedule import mok_schedule, ref_mok_schedule
from titan_mok.moe.dispatch import build_dispatch_handle, combine, dispatch
from titan_mok.moe.fused import build_fused_handle, fused_combine, fused_dispatch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _ids(kind: str, ranks: int, tokens: int, top_k: int, experts: int, seed: int) -> torch.Tensor:
    """int32 [P, T·K] top-k ids (distinct per token) for a routing pattern."""
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        ids = torch.rand(ranks * tokens, experts, generator=g).argsort(dim=1)[:, :top_k]
    elif kind == "one_expert":  # every token picks expert 1 (and the next K-1 experts)
        ids = (1 + torch.arange(top_k)).repeat(ranks * tokens, 1)
    elif kind == "all_remote":  # everything goes to the last rank's experts
        local = experts // ranks
        ids = (experts - local + torch.rand(ranks * tokens, local, generator=g).argsort(dim=1)[:, :top_k])
    else:
        raise ValueError(kind)
    return ids.to(torch.int32).reshape(ranks, tokens * top_k).to(DEVICE)


@pytest.mark.parametrize("kind", ["random", "one_expert", "all_remote"])
@pytest.mark.parametrize("ranks", [1, 2])
def test_schedule_matches_reference(kind, ranks):
    tokens, top_k, experts = 37, 3, 8
    ids_PN = _ids(kind, ranks, tokens, top_k, experts, seed=ranks)
    for rank in range(ranks):
        group_end, row_slot = mok_schedule(ids_PN, rank, experts // ranks, experts)
        ref_end, ref_slot = ref_mok_schedule(ids_PN, rank, experts // ranks)
        assert torch.equal(group_end.long().cpu(), ref_end.cpu()), (kind, rank)
        assert torch.equal(row_slot[: int(ref_end[-1])].long().cpu(), ref_slot.cpu()), (kind, rank)


def test_schedule_bad_args_name_them():
    with pytest.raises(ValueError, match="ids_PN must be contiguous int32"):
        mok_schedule(torch.zeros(2, 4, dtype=torch.int64, device=DEVICE), 0, 2, 4)
    with pytest.raises(ValueError, match="do not fit P = 2"):
        mok_schedule(torch.zeros(2, 4, dtype=torch.int32, device=DEVICE), 0, 3, 4)


def _rank_buffers(ranks: int, rows: int, dim: int, seed: int) -> list[torch.Tensor]:
    """Each simulated rank's buffer, tagged with the rank in its first column (DeepEP-style)."""
    g = torch.Generator().manual_seed(seed)
    bufs = [torch.randn(rows, dim, generator=g).to(torch.bfloat16) for _ in range(ranks)]
    for rank, buf in enumerate(bufs):
        buf[:, 0] = rank
    return [b.to(DEVICE) for b in bufs]


def _table(bufs: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=DEVICE)


@pytest.mark.parametrize("rows_div", [1, 3])
def test_pull_and_push_rows_across_simulated_ranks(rows_div):
    ranks, tokens, top_k, experts, dim = 2, 11, 3, 4, 1100  # dim > one column block
    slots = tokens * top_k
    ids_PN = _ids("random", ranks, tokens, top_k, experts, seed=5)
    remote = _rank_buffers(ranks, slots // rows_div, dim, seed=6)
    for rank in range(ranks):
        group_end, row_slot = mok_schedule(ids_PN, rank, experts // ranks, experts)
        num_rows = int(group_end[-1])
        pulled = torch.full((ranks * slots, dim), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        move_rows(pulled, _table(remote), row_slot, group_end, slots, rows_div, push=False)
        expected = ref_pull_rows(remote, row_slot[:num_rows].cpu(), slots, rows_div)
        assert torch.equal(pulled[:num_rows], expected)
        assert pulled[num_rows:].isnan().all()  # padding rows untouched

    # push: every slot of every rank is written exactly once over the ranks' schedules
    targets = [torch.full((slots, dim), float("nan"), dtype=torch.bfloat16, device=DEVICE) for _ in range(ranks)]
    expected = [t.clone() for t in targets]
    for rank in range(ranks):
        group_end, row_slot = mok_schedule(ids_PN, rank, experts // ranks, experts)
        rows = _rank_buffers(1, ranks * slots, dim, seed=10 + rank)[0]
        move_rows(rows, _table(targets), row_slot, group_end, slots, 1, push=True)
        ref_push_rows(rows, expected, row_slot[: int(group_end[-1])].cpu(), slots)
    for got, want in zip(targets, expected):
        assert not got.isnan().any()
        assert torch.equal(got, want)


@pytest.mark.parametrize("weighted, shared_dtype", [(True, torch.bfloat16), (True, torch.float32), (False, None)])
def test_slot_reduce_bitwise_equals_reference(weighted, shared_dtype):
    g = torch.Generator().manual_seed(3)
    tokens, top_k, dim = 5, 4, 1500
    slots = (torch.randn(tokens, top_k, dim, generator=g) * 3).to(torch.bfloat16).to(DEVICE)
    weights = torch.rand(tokens, top_k, generator=g).to(DEVICE) if weighted else None
    shared = torch.randn(tokens, dim, generator=g).to(shared_dtype).to(DEVICE) if shared_dtype else None
    copy = torch.empty_like(slots)
    out = slot_reduce(slots, weights, shared, torch.bfloat16, copy_TKH=copy)
    assert torch.equal(out, ref_slot_reduce(slots, weights, shared, torch.bfloat16))
    assert torch.equal(copy, slots)


def test_slot_scale_bitwise_equals_reference():
    g = torch.Generator().manual_seed(4)
    weights = torch.rand(6, 3, generator=g).to(DEVICE)
    dout = torch.randn(6, 1030, generator=g).to(torch.bfloat16).to(DEVICE)
    dy = torch.empty(6, 3, 1030, dtype=torch.bfloat16, device=DEVICE)
    slot_scale(weights, dout, dy)
    assert torch.equal(dy, ref_slot_scale(weights, dout, torch.bfloat16))


def test_fused_dispatch_combine_equal_reference_single_rank():
    """P = 1 (no group): fused dispatch → (a row-wise function) → combine and both backwards
    equal the reference backend's, bit for bit, on the real rows."""
    g = torch.Generator().manual_seed(7)
    tokens, top_k, experts, dim = 9, 2, 4, 64
    topk_idx = torch.rand(tokens, experts, generator=g).argsort(dim=1)[:, :top_k].to(DEVICE)
    x = torch.randn(tokens, dim, generator=g).to(torch.bfloat16).to(DEVICE)
    weights = torch.rand(tokens, top_k, generator=g).to(DEVICE)
    shared = torch.randn(tokens, dim, generator=g).to(torch.bfloat16).to(DEVICE)
    dout = torch.randn(tokens, dim, generator=g).to(torch.bfloat16).to(DEVICE)

    def run(fused: bool):
        xs, ws, ss = (t.clone().requires_grad_() for t in (x, weights, shared))
        if fused:
            handle = build_fused_handle(topk_idx, experts, None, dim, torch.bfloat16)
            rows = fused_dispatch(xs, handle)
            y = fused_combine(rows * 3, ws, ss, handle, torch.bfloat16)
            num_rows = int(handle.group_end[-1])
        else:
            handle = build_dispatch_handle(topk_idx, experts, None, None)
            rows = dispatch(xs, handle)
            y = combine(rows * 3, ws, ss, handle, torch.bfloat16)
            num_rows = rows.shape[0]
        y.backward(dout)
        return rows[:num_rows].detach(), y.detach(), xs.grad, ws.grad, ss.grad

    for name, a, b in zip(("rows", "y", "dx", "dweights", "dshared"), run(True), run(False)):
        assert torch.equal(a, b), name
    first, second = run(True), run(True)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_max_rows_below_worst_case_is_refused():
    topk_idx = torch.zeros(4, 2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="max_rows_per_rank = 3"):
        build_fused_handle(topk_idx, 4, None, 32, torch.bfloat16, max_rows_per_rank=3)
