"""DeepSeek-V4's cached decode step (titan_mok.rl.cached_dsv4): token by token through
the stand-ins, every logit equals the trainer's full pass bit for bit, across the
sliding window, HCA and CSA entry completions and the indexer's top-k, with the
sequences of one batch at different positions."""

import copy

import pytest
import torch

from titan_mok import registry
from titan_mok.rl import cached_dsv4
from titan_mok.rl.generate import CachedDecoder, has_kv_cache_step
from titan_mok.rl.invariant import BatchInvariantMode

SEQ_LEN, PAD = 48, 0


@pytest.fixture(scope="module")
def model():
    args = copy.deepcopy(registry.flavors("deepseek_v4_pro")["debug"])
    args.max_seq_len = SEQ_LEN
    # within SEQ_LEN: the window slides, HCA and CSA entries complete, the indexer drops entries
    assert args.sliding_window < SEQ_LEN and args.hca_ratio < SEQ_LEN // 2
    assert args.index_topk < SEQ_LEN // args.csa_ratio - 2
    assert {0, args.csa_ratio, args.hca_ratio} <= set(args.compress_ratios)
    torch.manual_seed(0)
    m = registry.model_module("deepseek_v4_pro").get_train_spec().model_cls(args)
    m.init_weights()
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: FSDP's mixed-precision compute
def test_decoding_token_by_token_equals_the_full_pass(model, dtype):
    model = copy.deepcopy(model).to(dtype)
    assert cached_dsv4.supports(model) and has_kv_cache_step(model)
    tokens_BS = torch.randint(3, 100, (3, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    prompt_len_B = torch.tensor([5, 1, 18])
    rows_B = torch.arange(3)
    # as in generate: the buffer holds each prompt, then padding that each step overwrites
    # (the prefill also runs over the shorter prompts' padding; decoding must replace it)
    buffer_BS = tokens_BS.masked_fill(torch.arange(SEQ_LEN) >= prompt_len_B[:, None], PAD)
    with torch.no_grad(), BatchInvariantMode():
        full_BSV = model(tokens_BS)  # the trainer's forward
        decoder = CachedDecoder(model, buffer_BS)
        with decoder.running():
            logits_BV = decoder.prefill(prompt_len_B, int(prompt_len_B.max()))
            assert torch.equal(logits_BV, full_BSV[rows_B, prompt_len_B - 1])
            # sequences at different positions; the ones that reach the end re-decode the last one
            for step in range(SEQ_LEN - int(prompt_len_B.min())):
                pos_B = (prompt_len_B + step).clamp(max=SEQ_LEN - 1)
                buffer_BS[rows_B, pos_B] = tokens_BS[rows_B, pos_B]
                logits_BV = decoder.next_logits(pos_B)
                assert torch.equal(logits_BV, full_BSV[rows_B, pos_B]), pos_B.tolist()
    assert torch.equal(buffer_BS, tokens_BS)


def test_the_trainer_forward_is_unchanged_by_the_mode_up_to_rounding(model):
    """The refactored attention (per-sequence entry products, per-group output projection,
    tiled sigmoids) computes the same function with and without BatchInvariantMode."""
    tokens_BS = torch.randint(3, 100, (2, SEQ_LEN), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        plain = model(tokens_BS)
        with BatchInvariantMode():
            invariant = model(tokens_BS)
    torch.testing.assert_close(invariant, plain, rtol=1e-5, atol=1e-5)
