"""Qwen3.5's cached decode step, layer by layer: the stand-ins of ``titan_mok.rl.cached_qwen``
fed a prefill of unequal prompts and then one token per sequence per step give, bit for bit,
the module's full forward at every position (``tests/rl/test_rl.py`` checks whole rollouts)."""

import pytest
import torch

from titan_mok.models.qwen3_5_397b_a17b import Qwen35ModelArgs
from titan_mok.models.qwen3_5_397b_a17b.gated_deltanet import GatedDeltaNet
from titan_mok.models.qwen3_5_397b_a17b.model import GatedAttention, qwen_rope_cache
from titan_mok.rl.cached_qwen import CachedGatedAttention, CachedGatedDeltaNet
from titan_mok.rl.invariant import BatchInvariantMode
from titan_mok.rl.kv_cache import LayerKVCache, Positions

SEQ_LEN, DIM, CHUNK = 40, 32, 8
PROMPT_LEN = torch.tensor([1, 2, 8, 13, 16])  # one token, shorter than the conv, a chunk, ragged, two chunks


def _decode_everywhere(mixer, stand_in, positions, x_BSH, *extra):
    """Full forward vs prefill of the padded prompts + one token per step, at every position."""
    with torch.no_grad(), BatchInvariantMode():
        full_BSH = mixer(x_BSH, *extra)
        bsz, max_prompt = len(PROMPT_LEN), int(PROMPT_LEN.max())
        positions.start, positions.pos_BT = 0, torch.arange(max_prompt).expand(bsz, max_prompt)
        positions.prompt_len_B = PROMPT_LEN
        prefill_BPH = stand_in(x_BSH[:, :max_prompt], *extra)
        for b, prompt_len in enumerate(PROMPT_LEN.tolist()):
            assert torch.equal(prefill_BPH[b, :prompt_len], full_BSH[b, :prompt_len]), f"prefill of sequence {b}"
        rows_B = torch.arange(bsz)
        for pos_B in PROMPT_LEN + torch.arange(SEQ_LEN - int(PROMPT_LEN.max()))[:, None]:
            positions.start, positions.pos_BT = pos_B, pos_B[:, None]
            out_B1H = stand_in(x_BSH[rows_B, pos_B][:, None], *extra)
            assert torch.equal(out_B1H[:, 0], full_BSH[rows_B, pos_B]), f"positions {pos_B.tolist()}"


def test_deltanet_decode_step_equals_the_chunked_pass():
    """Decoding crosses chunk boundaries (C = 8) at different steps for each sequence; the
    chunk state, the chunk's inputs and the conv's left context carry over bit for bit."""
    torch.manual_seed(0)
    mixer = GatedDeltaNet(DIM, 2, 4, 8, 8, conv_kernel=4, norm_eps=1e-6, chunk_size=CHUNK)
    mixer.init_weights(0.02)
    positions = Positions()
    x_BSH = torch.randn(len(PROMPT_LEN), SEQ_LEN, DIM)
    _decode_everywhere(mixer, CachedGatedDeltaNet(mixer, positions), positions, x_BSH)


def test_gated_attention_decode_step_equals_the_full_pass():
    args = Qwen35ModelArgs(dim=DIM, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=SEQ_LEN, n_mtp_layers=0)
    torch.manual_seed(0)
    attn = GatedAttention(args)
    attn.init_weights(0.02)
    positions = Positions()
    stand_in = CachedGatedAttention(attn, LayerKVCache(len(PROMPT_LEN), SEQ_LEN), positions)
    _decode_everywhere(attn, stand_in, positions, torch.randn(len(PROMPT_LEN), SEQ_LEN, DIM), qwen_rope_cache(args))


@pytest.mark.parametrize(
    "start, prompt_len_B", [(3, torch.tensor([5])), (0, None)], ids=["not-at-0", "no-prompt-lengths"]
)
def test_deltanet_stand_in_rejects_a_multi_token_step_that_is_no_prefill(start, prompt_len_B):
    mixer = GatedDeltaNet(DIM, 2, 4, 8, 8, conv_kernel=4, norm_eps=1e-6, chunk_size=CHUNK)
    positions = Positions(start=start, pos_BT=torch.arange(start, start + 2)[None], prompt_len_B=prompt_len_B)
    with pytest.raises(ValueError, match="must be the prefill"):
        CachedGatedDeltaNet(mixer, positions)(torch.randn(1, 2, DIM))
