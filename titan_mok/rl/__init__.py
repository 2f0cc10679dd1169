"""RL post-training: GRPO with deterministic KV-cache rollouts through the training
model's own modules and bitwise rollout/trainer logprob parity (docs/design.md §8).

`torchrun --nproc_per_node N -m titan_mok.rl --config PATH [--section.key value ...]`

Modules: ``invariant`` (batch-invariant linear and attention), ``sampling``
(per-sequence streams, temperature/top-p, logprobs), ``generate`` (KV-cache decode),
``tasks`` (verifiable prompts and rewards), ``grpo`` (advantages, clipped loss),
``reference`` (the KL penalty's frozen policy),
``trainer`` (the step, on TorchTitan's Trainer).
"""
