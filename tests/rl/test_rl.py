"""titan_mok.rl in one process: rollouts vs the trainer's forward, bit for bit;
batch independence of samples; sampling streams; GRPO maths; config errors."""

import copy

import pytest
import torch
import torch.nn.functional as F

from titan_mok import registry
from titan_mok.config import Rl
from titan_mok.data import CharTokenizer
from titan_mok.models.kimi_k2_7_code import KimiK27CodeModel, kimi_k2_7_code_configs
from titan_mok.rl.generate import generate, has_kv_cache_step, varying_token_counts
from titan_mok.rl.grpo import clipped_pg_loss_sum, group_advantages
from titan_mok.rl.invariant import BatchInvariantMode, invariant_attention
from titan_mok.rl.reference import ReferencePolicy
from titan_mok.rl.sampling import sample, sequence_key, token_logprobs
from titan_mok.rl.tasks import make_prompt, reward
from titan_mok.config_check import ConfigError, MokConfigManager
from titan_mok.moe import MoE
from titan_mok.moe.moe import routed_schedule
from titan_mok.rl.trainer import ParityError, check_rl_job, completion_logprobs, judge_parity

SEQ_LEN, NEW = 48, 20
TOK = CharTokenizer()


@pytest.fixture(scope="module")
def model():
    args = copy.deepcopy(kimi_k2_7_code_configs["debug"])
    args.max_seq_len = SEQ_LEN
    torch.manual_seed(0)
    m = KimiK27CodeModel(args)
    m.init_weights()
    return m


def _rollout(model, prompt_ids: list[int], samples: int = 2, top_p: float = 0.9, new: int = NEW):
    prompts = [make_prompt(3, i) for i in prompt_ids]
    ids = [TOK.encode(p.text, add_bos=True) for p in prompts for _ in range(samples)]
    device = next(model.parameters()).device
    keys = torch.tensor([sequence_key(3, 1, p.index, j) for p in prompts for j in range(samples)], device=device)
    with BatchInvariantMode():
        return generate(
            model, ids, keys, seq_len=SEQ_LEN, max_new_tokens=new, temperature=1.0, top_p=top_p,
            stop_ids=(TOK.eos_id, TOK.encode("\n")[0]), pad_id=TOK.pad_id,
        )


def _assert_parity(model, rollout) -> None:
    assert rollout.mask_BG.sum() > 3 * rollout.mask_BG.shape[0], "completions too short to test anything"
    with BatchInvariantMode():
        logits_BSV = model(rollout.tokens_BS)  # the trainer's forward: model.forward, all positions at once
    recomputed_BG = completion_logprobs(logits_BSV, rollout, temperature=1.0)
    mask = rollout.mask_BG
    assert torch.equal(recomputed_BG[mask], rollout.logprobs_BG[mask])


def test_rollout_logprobs_equal_trainer_recompute(model):
    assert has_kv_cache_step(model)
    _assert_parity(model, _rollout(model, list(range(6))))


def test_rollout_parity_under_autocast(model):
    """TorchTitan's AMP (one device, no FSDP): the rollout and the trainer's forward both run under
    autocast, and the batch-invariant linear computes in its dtype as F.linear would."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rollout = _rollout(model, list(range(4)))
        assert rollout.logprobs_BG.dtype == torch.float32
        _assert_parity(model, rollout)
    with torch.autocast("cpu", dtype=torch.bfloat16), BatchInvariantMode():
        w_NK = model.output.weight
        x_MK = torch.randn(5, w_NK.shape[1])
        assert F.linear(x_MK, w_NK).dtype == torch.bfloat16


def _debug_model(name: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
    args = copy.deepcopy(registry.flavors(name)["debug"])
    args.max_seq_len = SEQ_LEN
    torch.manual_seed(0)
    m = registry.model_module(name).get_train_spec().model_cls(args)
    m.init_weights()
    return m.to(device, dtype)


def _check_cached_rollouts(model) -> None:
    """Bitwise parity, and prompt 1's samples the same alone and in a batch."""
    assert has_kv_cache_step(model)
    batch = _rollout(model, [0, 1, 2])
    _assert_parity(model, batch)
    # GLM: positions past index_topk = 32, where DSA really selects; Qwen: past two DeltaNet chunks
    assert (batch.prompt_len_B[:, None] + batch.mask_BG.sum(1, keepdim=True)).max() > 33
    alone = _rollout(model, [1])
    assert torch.equal(alone.completion_BG, batch.completion_BG[2:4])
    assert torch.equal(alone.logprobs_BG, batch.logprobs_BG[2:4])


@pytest.mark.parametrize("name", ["glm_5_2", "qwen3_5_397b_a17b", "deepseek_v4_pro"])
def test_rollouts_of_the_other_models(name):
    """Each model's own cached step (titan_mok/rl/cached_*.py): GLM's DSA also caches the
    indexer's keys, Qwen3.5's DeltaNet its chunk state, DeepSeek-V4 its window and
    compressed entries."""
    _check_cached_rollouts(_debug_model(name))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["kimi_k2_7_code", "glm_5_2", "qwen3_5_397b_a17b", "deepseek_v4_pro"])
def test_cached_rollouts_on_gpu_in_bf16(name):
    """The same on CUDA in bf16 (FSDP's compute dtype on the GPU): checks the assumptions the
    CPU cannot (cuBLAS batched GEMMs and solves, CUDA reductions, cumsum and topk giving
    each row the same bits at the decode step's sizes as at the trainer's)."""
    _check_cached_rollouts(_debug_model(name, "cuda", torch.bfloat16))


def test_sample_is_the_same_alone_and_in_batches(model):
    batch = _rollout(model, [0, 1, 2, 3, 4, 5])
    alone = _rollout(model, [4], samples=2)
    other = _rollout(model, [9, 4, 7])  # another batch size, prompt 4 at another row
    for rollout, row in ((alone, 0), (other, 2)):
        for field in ("completion_BG", "logprobs_BG", "mask_BG"):
            # prompt 4's two samples: rows 8, 9 of the batch
            assert torch.equal(getattr(rollout, field)[row : row + 2], getattr(batch, field)[8:10]), field

def test_batch_invariant_ops_match_reference_and_rows():
    torch.manual_seed(1)
    q, k, v = torch.randn(3, 2, 21, 8), torch.randn(3, 2, 21, 8), torch.randn(3, 2, 21, 6)
    x, w = torch.randn(5, 21, 16), torch.randn(12, 16)
    with BatchInvariantMode():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
        y = F.linear(x, w)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3))
    torch.testing.assert_close(y, F.linear(x, w))
    k2, v2 = k[:, :1], v[:, :1]  # grouped-query attention: one kv head for two query heads
    with BatchInvariantMode():
        gqa = F.scaled_dot_product_attention(q, k2, v2, is_causal=True, scale=0.3, enable_gqa=True)
    expected = F.scaled_dot_product_attention(q, k2, v2, is_causal=True, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(gqa, expected)
    # query 7 of sequence 1, alone against the same keys: the same bits
    one = invariant_attention(q[1:2, :, 7:8], k[1:2], v[1:2], 0.3, torch.tensor([7]))
    assert torch.equal(one[0, :, 0], out[1, :, 7])
    with BatchInvariantMode():
        assert torch.equal(F.linear(x[2, 3:4], w), y[2, 3:4])
        means = x.mean(-1, keepdim=True)
        assert torch.equal(torch.mean(x[2, 3:4], dim=-1), means[2, 3:4, 0])
    torch.testing.assert_close(means, x.mean(dim=-1, keepdim=True))


def test_sampling_streams():
    keys = torch.tensor([sequence_key(1, 2, 3, s) for s in range(4)])
    assert len(set(keys.tolist())) == 4 and sequence_key(1, 2, 3, 0) == sequence_key(1, 2, 3, 0)
    assert sequence_key(1, 2, 3, 0) != sequence_key(2, 2, 3, 0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -8.0]]).expand(4000, 5)
    many_keys = torch.tensor([sequence_key(0, 0, i, 0) for i in range(4000)])
    tokens, logp = sample(logits, many_keys, t=0, temperature=1.0, top_p=1.0)
    freq = torch.bincount(tokens, minlength=5).float() / 4000
    torch.testing.assert_close(freq, torch.softmax(logits[0], -1), atol=0.03, rtol=0)
    assert torch.equal(logp, token_logprobs(logits, tokens, 1.0))
    # top-p 0.7 keeps tokens 0 and 1 (mass 0.64 before token 1 < 0.7 ≤ 0.88)
    tokens, _ = sample(logits, many_keys, t=5, temperature=1.0, top_p=0.7)
    assert set(tokens.tolist()) == {0, 1}
    again, _ = sample(logits[:3], many_keys[:3], t=5, temperature=1.0, top_p=0.7)
    assert torch.equal(again, tokens[:3])


def test_grpo_maths():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), group_size=2)
    torch.testing.assert_close(adv, torch.tensor([0.7071, -0.7071, 0.0, 0.0]), atol=1e-3, rtol=0)
    old = torch.zeros(2, 3)
    new = torch.tensor([[0.5, 0.0, 0.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    loss, stats = clipped_pg_loss_sum(new, old, torch.tensor([1.0, -1.0]), mask, clip_eps=0.2)
    # token (0,0): ratio e^0.5 clipped to 1.2; token (0,1): 1;
    # token (1,0): ratio e^-0.5, A = −1 → min picks the clipped 0.8·(−1)
    torch.testing.assert_close(loss, torch.tensor(-(1.2 + 1.0 - 0.8)))
    assert stats["clipped_tokens"] == 2
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(5), group_size=2)


def test_reference_policy_swaps_in_and_back(model):
    model = copy.deepcopy(model)  # moved below; the module's model is shared
    tokens = torch.randint(3, 100, (2, 12))
    reference = ReferencePolicy(model)
    before = model(tokens).detach()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    moved = model(tokens).detach()
    with reference.swapped_in(model):
        assert torch.equal(model(tokens), before)
    assert torch.equal(model(tokens), moved)
    reference.reset_to(model)
    with reference.swapped_in(model):
        assert torch.equal(model(tokens), moved)


def test_reward():
    assert reward("1 3 5 8\nxyz", "1 3 5 8") == 1.0
    assert reward("1 3 5", "1 3 5 8") == 5 / 7
    assert reward("1 3 5 8 9", "1 3 5 8") == 7 / 9
    assert reward("2 3x5 8", "1 3 5 8") == (5 + 0.5) / 7  # '2' for '1': a digit; 'x' for ' ': no credit
    assert reward("", "42") == 0.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"group_size": 1}, r"\[rl\] group_size = 1"),
        ({"top_p": 1.5}, r"\[rl\] top_p = 1.5"),
        ({"temperature": 0.0}, r"\[rl\] temperature = 0.0"),
        ({"max_new_tokens": 0}, r"\[rl\] max_new_tokens = 0"),
        ({"parity": "ignore"}, r"\[rl\] parity = 'ignore'"),
    ],
)
def test_rl_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Rl(**kwargs)


def test_prompt_too_long_is_an_error(model):
    with pytest.raises(ValueError, match=r"max_new_tokens = 20 within \[training\] seq_len = 30"):
        generate(
            model, [[1] * 11], torch.tensor([0]), seq_len=30, max_new_tokens=20, temperature=1.0, top_p=1.0,
            stop_ids=(2,), pad_id=0,
        )


def test_parity_verdict(caplog):
    judge_parity(0.0, 3, "fail")
    with pytest.raises(ParityError, match=r"step 3: .*max abs diff 1e-07"):
        judge_parity(1e-7, 3, "fail")
    judge_parity(1e-7, 4, "warn")
    assert "step 4: rollout and trainer logprobs differ" in caplog.text


def test_rl_job_checks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # the config's 2 ranks
    registry.register_all()
    base = ["--job.config_file", "train_configs/kimi_k2_7_code/rl_debug.toml"]
    check_rl_job(MokConfigManager().parse_args(base))
    with pytest.raises(ConfigError, match=r"\[training\] seq_len = 20 must exceed \[rl\] max_new_tokens = 20"):
        check_rl_job(MokConfigManager().parse_args([*base, "--training.seq_len", "20"]))
    for kernels in ("triton", "megakernel"):
        config = MokConfigManager().parse_args(base)
        config.mok.kernels = kernels  # (on CPU the general check rejects it first)
        with pytest.raises(ConfigError, match=rf"\[mok\] kernels = '{kernels}' is not supported by RL rollouts"):
            check_rl_job(config)


def test_rollouts_keep_auto_on_the_reference_schedule(model, monkeypatch):
    """Rollout calls change their token count from call to call (and between ranks): inside ``generate`` "auto"
    does not take the fused path, whose buffers are allocated per count (titan_mok.moe.moe.routed_schedule)."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert layers and all(m.fixed_token_count for m in layers)
    with varying_token_counts(model):
        assert not any(m.fixed_token_count for m in layers)
        assert all(routed_schedule("auto", None, True, m.fixed_token_count) == "reference" for m in layers)
    assert all(m.fixed_token_count for m in layers)
    seen = []

    def recording(layer):
        def schedule(x_TH):
            seen.append(layer.fixed_token_count)
            return "reference"
        return schedule

    for layer in layers:
        monkeypatch.setattr(layer, "_schedule", recording(layer))
    _rollout(model, [0], new=2)
    assert seen and not any(seen)
    assert all(m.fixed_token_count for m in layers)
