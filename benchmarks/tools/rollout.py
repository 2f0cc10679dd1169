"""Rollout decoding, one process: the model family's cached step against recomputation
(``RecomputeDecoder``: a full ``model.forward`` per generated token), same prompts and
streams; prints tokens/s of each and whether the two rollouts are bitwise equal.

    OMP_NUM_THREADS=1 python -m benchmarks.tools.rollout --model qwen3_5_397b_a17b --seq-len 192

The ``debug`` flavor from a random init; 8 prompts of 8–15 tokens, no stop token, so
every sequence decodes ``seq_len − 20`` tokens. Under ``BatchInvariantMode``, as RL runs.
"""

import argparse
import copy
import time
from unittest import mock

import torch

from titan_mok import registry
from titan_mok.rl import generate as generate_module
from titan_mok.rl.invariant import BatchInvariantMode


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3_5_397b_a17b")
    parser.add_argument("--seq-len", type=int, default=192)
    opts = parser.parse_args()
    args = copy.deepcopy(registry.flavors(opts.model)["debug"])
    args.max_seq_len = opts.seq_len
    torch.manual_seed(0)
    model = registry.model_module(opts.model).get_train_spec().model_cls(args)
    model.init_weights()
    if not generate_module.has_kv_cache_step(model):
        raise SystemExit(f"{opts.model} has no cached decode step: nothing to compare")
    prompts = [[1, *range(5, 13 + i)] for i in range(8)]
    new_tokens = opts.seq_len - 20
    rollouts = {}
    for name, cached in (("cached", True), ("recompute", False)):
        with mock.patch.object(generate_module, "has_kv_cache_step", lambda _model, cached=cached: cached):
            start = time.perf_counter()
            with BatchInvariantMode():
                rollouts[name] = generate_module.generate(
                    model, prompts, torch.arange(len(prompts)), seq_len=opts.seq_len, max_new_tokens=new_tokens,
                    temperature=1.0, top_p=1.0, stop_ids=(-1,), pad_id=0,
                )
            seconds = time.perf_counter() - start
        print(f"{opts.model} seq_len {opts.seq_len} {name}: {len(prompts) * new_tokens / seconds:.0f} tok/s "
              f"({len(prompts)} × {new_tokens} tokens in {seconds:.2f} s)")
    same = all(
        torch.equal(getattr(rollouts["cached"], field), getattr(rollouts["recompute"], field))
        for field in ("completion_BG", "logprobs_BG")
    )
    print(f"cached and recompute rollouts bitwise equal: {same}")


if __name__ == "__main__":
    main()
