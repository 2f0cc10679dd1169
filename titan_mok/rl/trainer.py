"""GRPO on TorchTitan's Trainer: its model, parallelism, optimizer, LR schedule,
metrics and DCP checkpointing; only the step differs (rollout → rewards →
group-relative advantages → clipped policy-gradient updates).

Legend: B sequences on this rank (prompts × group_size), S sequence length,
V vocab, G completion tokens.

Determinism: prompts are a function of (seed, prompt index), sampling streams
of (seed, step, prompt index, sample index), and every op on the forward path
is batch-invariant (``BatchInvariantMode``), so two runs of one config give the
same rollouts, rewards, losses and weights, bit for bit, and a run resumed from
a checkpoint (which holds the step and the prompt index) continues as the
uninterrupted one would.
"""

import hashlib
import time
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from torchtitan.distributed import utils as dist_utils
from torchtitan.tools.logging import logger
from torchtitan.train import Trainer

from titan_mok.attached_loss import loss_weight, without_losses
from titan_mok.checkpoint import MokCheckpointManager
from titan_mok.config_check import ConfigError
from titan_mok.kernels import weight_cache
from titan_mok.moe import MoE
from titan_mok.rl.generate import Rollout, generate, has_kv_cache_step
from titan_mok.rl.grpo import clipped_pg_loss_sum, group_advantages
from titan_mok.rl.invariant import BatchInvariantMode
from titan_mok.rl.reference import ReferencePolicy
from titan_mok.rl.sampling import sequence_key, token_logprobs
from titan_mok.rl.tasks import make_prompt, reward


class ParityError(RuntimeError):
    """The trainer's recomputed logprobs differ from the rollout's ([rl] parity = "fail")."""


def judge_parity(diff: float, step: int, mode: str) -> None:
    """``[rl] parity``: a nonzero rollout/trainer logprob difference warns or stops the run
    (every rank sees the same all-reduced ``diff``, so all stop together)."""
    if diff == 0:
        return
    message = (
        f"step {step}: rollout and trainer logprobs differ (max abs diff {diff:.3g}); "
        "an op on the forward path is not batch-invariant"
    )
    if mode == "fail":
        raise ParityError(message + " ([rl] parity = 'fail')")
    logger.warning(message)


def check_rl_job(job_config) -> None:
    """RL-specific config checks, before any process group exists."""
    if job_config.debug.seed is None:
        raise ConfigError("[debug] seed must be set for RL: prompts and sampling streams derive from it")
    if job_config.training.seq_len <= job_config.rl.max_new_tokens:
        raise ConfigError(
            f"[training] seq_len = {job_config.training.seq_len} must exceed [rl] max_new_tokens = "
            f"{job_config.rl.max_new_tokens} (it holds prompt + completion)"
        )
    if job_config.mok.kernels in ("triton", "megakernel"):
        # The symmetric-memory path needs the same token count on every EP rank; each rank's
        # rollout prefill has its own prompt length. The megakernel's workspace is per token count.
        raise ConfigError(f"[mok] kernels = {job_config.mok.kernels!r} is not supported by RL rollouts; "
                          "use 'reference' or 'auto'")


@contextmanager
def moe_counts_kept(model: torch.nn.Module):
    """Rollout forwards leave the MoE layers' token counts (read by the load-balancing
    bias update and the metrics) as they were: only training tokens count."""
    saved = [(m, m.tokens_per_expert.clone(), m.expert_load.clone()) for m in model.modules() if isinstance(m, MoE)]
    try:
        yield
    finally:
        for module, tokens_per_expert, expert_load in saved:
            module.tokens_per_expert.copy_(tokens_per_expert)
            module.expert_load.copy_(expert_load)


def completion_logprobs(logits_BSV: torch.Tensor, rollout: Rollout, temperature: float) -> torch.Tensor:
    """Logprobs ``[B, G]`` of the rollout's completion tokens under ``logits_BSV``
    (position n + t − 1 predicts completion token t of a prompt of n tokens)."""
    bsz, _, vocab = logits_BSV.shape
    num_new = rollout.completion_BG.shape[1]
    pos_BG = rollout.prompt_len_B[:, None] - 1 + torch.arange(num_new, device=logits_BSV.device)
    logits_BGV = logits_BSV.gather(1, pos_BG[..., None].expand(bsz, num_new, vocab))
    return token_logprobs(logits_BGV.reshape(-1, vocab), rollout.completion_BG.reshape(-1), temperature).view(
        bsz, num_new
    )


def _digest(*tensors: torch.Tensor) -> str:
    """SHA-256 of the tensors' bytes. NOTE: host copies (once per step, for the metrics)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _as_float(hexdigest: str) -> float:
    """52 bits of a digest as an exactly representable float (scalar loggers take floats)."""
    return float(int(hexdigest[:13], 16))


class RlTrainer(Trainer):
    def __init__(self, job_config):
        super().__init__(job_config)
        self.checkpointer = MokCheckpointManager.replacing(self)  # docs/faults.md: partial saves, checked loads
        self.optimizers.register_step_post_hook(weight_cache.step_post_hook(self.model_parts))
        self.model = self.model_parts[0]
        cached = has_kv_cache_step(self.model)
        logger.info("RL rollouts: " + ("KV-cache decoding" if cached else "recomputation (no KV-cache step yet)"))
        self.seed = job_config.debug.seed
        if self.parallel_dims.dp_enabled:
            batch_mesh = self.parallel_dims.get_mesh("batch")
            self.dp_degree, self.dp_rank = batch_mesh.size(), batch_mesh.get_local_rank()
            self.dp_group = batch_mesh.get_group()
        else:
            self.dp_degree, self.dp_rank, self.dp_group = 1, 0, None
        self.prompt_index = 0  # next global prompt index: the RL data position
        # The reference policy's tensors exist before the checkpoint loads (DCP loads into them);
        # unless a resume restores them, they take the weights the first step starts from.
        self.reference = ReferencePolicy(self.model) if job_config.rl.kl_coef > 0 else None
        self.reference_restored = False

    # ---- cross-rank reductions over the data-parallel ranks ----
    def _all_gather(self, x: torch.Tensor) -> torch.Tensor:
        if self.dp_group is None:
            return x
        parts = [torch.empty_like(x) for _ in range(self.dp_degree)]
        dist.all_gather(parts, x.contiguous(), group=self.dp_group)
        return torch.cat(parts)

    def _all_reduce(self, x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.dp_group is not None:
            dist.all_reduce(x, op=op, group=self.dp_group)
        return x

    # ---- one RL step ----
    def _rollout(self) -> tuple[Rollout, list, float]:
        rl = self.job_config.rl
        first = self.prompt_index + self.dp_rank * rl.prompts_per_rank
        prompts = [make_prompt(self.seed, first + i) for i in range(rl.prompts_per_rank)]
        self.prompt_index += rl.prompts_per_rank * self.dp_degree
        token_ids = [self.tokenizer.encode(p.text, add_bos=True) for p in prompts for _ in range(rl.group_size)]
        keys_B = torch.tensor(
            [sequence_key(self.seed, self.step, p.index, j) for p in prompts for j in range(rl.group_size)],
            device=self.device,
        )
        start = time.perf_counter()
        # under the trainer's AMP context (one GPU: autocast), so that its logprobs can match the trainer's
        with self.maybe_enable_amp, BatchInvariantMode(), moe_counts_kept(self.model):
            rollout = generate(
                self.model,
                token_ids,
                keys_B,
                seq_len=self.job_config.training.seq_len,
                max_new_tokens=rl.max_new_tokens,
                temperature=rl.temperature,
                top_p=rl.top_p,
                stop_ids=(self.tokenizer.eos_id, self.tokenizer.encode("\n")[0]),
                pad_id=self.tokenizer.pad_id,
            )
        return rollout, prompts, time.perf_counter() - start

    def train_step(self, data_iterator):
        """One GRPO step; ``data_iterator`` (the pretraining stream) is not read."""
        rl = self.job_config.rl
        rollout, prompts, rollout_s = self._rollout()
        self.metrics_processor.data_loading_times.append(0.0)  # prompts are generated inside the rollout

        # NOTE: host sync: rewards score decoded text.
        completions = [self.tokenizer.decode(c) for c in rollout.completion_BG.tolist()]
        answers = [p.answer for p in prompts for _ in range(rl.group_size)]
        rewards_B = torch.tensor([reward(c, a) for c, a in zip(completions, answers)], device=self.device)
        advantages_B = group_advantages(rewards_B, rl.group_size)
        mask_BG = rollout.mask_BG
        global_tokens = self._all_reduce(mask_BG.sum().float())
        local_share = mask_BG.sum() / global_tokens
        ref_logprobs_BG = self._reference_logprobs(rollout) if self.reference is not None else None

        start = time.perf_counter()
        lr = self.lr_schedulers.schedulers[0].get_last_lr()[0]
        for update in range(rl.updates_per_rollout):
            self.optimizers.zero_grad()
            # attached losses (MoE aux) count as this rank's share of the step's completion tokens; the
            # MTP loss is off: a language-modelling loss on rollouts would fit the policy to its own
            # samples (padding included) beside the policy gradient
            with (self.train_context(), self.maybe_enable_amp, BatchInvariantMode(), loss_weight(local_share),
                  without_losses("mtp")):
                logits_BSV = self.model(rollout.tokens_BS)
                logprobs_BG = completion_logprobs(logits_BSV, rollout, rl.temperature)
                del logits_BSV
                loss_sum, stats = clipped_pg_loss_sum(
                    logprobs_BG, rollout.logprobs_BG, advantages_B, mask_BG, rl.clip_eps, ref_logprobs_BG, rl.kl_coef
                )
                loss = loss_sum / global_tokens
            if update == 0:
                parity = self._check_parity(logprobs_BG.detach(), rollout)
            loss.backward()
            grad_norm = dist_utils.clip_grad_norm_(
                list(self.model.parameters()),
                self.job_config.training.max_norm,
                foreach=True,
                pp_mesh=None,
                ep_enabled=self.parallel_dims.ep_enabled,
            )
            self.checkpointer.maybe_wait_for_staging()
            self.optimizers.step()
        self.lr_schedulers.step()
        train_s = time.perf_counter() - start
        train_tokens = rollout.tokens_BS.numel() * rl.updates_per_rollout
        self.ntokens_seen += train_tokens
        self.metrics_processor.ntokens_since_last_log += train_tokens

        metrics = self._metrics(
            rewards_B, advantages_B, rollout, stats, global_tokens, rollout_s, train_tokens / train_s
        )
        metrics.update({"rl/logprob_max_abs_diff": parity, "lr": lr})
        if self.metrics_processor.should_log(self.step):
            loss_global = self._all_reduce(loss.detach().clone()).item()
            self.metrics_processor.log(self.step, loss_global, loss_global, grad_norm.item(), extra_metrics=metrics)
            logger.info(
                f"rl step {self.step}: reward {metrics['rl/reward_mean']:.4f} ± {metrics['rl/reward_std']:.4f}, "
                f"logprob_max_abs_diff {parity:.3g}, kl {metrics['rl/kl']:.3g}, "
                f"clip {metrics['rl/clip_fraction']:.3f}, rollout {metrics['rl/rollout_tokens_per_s']:.0f} tok/s"
            )

    def _reference_logprobs(self, rollout: Rollout) -> torch.Tensor:
        if not self.reference_restored:
            self.reference.reset_to(self.model)
            self.reference_restored = True
        with (torch.no_grad(), self.maybe_enable_amp, BatchInvariantMode(), moe_counts_kept(self.model),
              self.reference.swapped_in(self.model)):
            return completion_logprobs(self.model(rollout.tokens_BS), rollout, self.job_config.rl.temperature)

    def _check_parity(self, logprobs_BG: torch.Tensor, rollout: Rollout) -> float:
        """Max |trainer − rollout| logprob over every rank's generated tokens."""
        diff_BG = torch.where(rollout.mask_BG, (logprobs_BG - rollout.logprobs_BG).abs(), 0.0)
        diff = self._all_reduce(diff_BG.max(), op=dist.ReduceOp.MAX).item()  # NOTE: host sync
        judge_parity(diff, self.step, self.job_config.rl.parity)
        return diff

    def _metrics(self, rewards_B, advantages_B, rollout, stats, global_tokens, rollout_s, train_tps) -> dict[str, Any]:
        rewards_X, advantages_X = self._all_gather(rewards_B), self._all_gather(advantages_B)
        sums = self._all_reduce(torch.stack([stats["kl_sum"], stats["clipped_tokens"], stats["ref_kl_sum"]]).detach())
        digests = [_digest(rollout.tokens_BS, rollout.logprobs_BG, rewards_B)] * self.dp_degree
        if self.dp_group is not None:
            dist.all_gather_object(digests, digests[0], group=self.dp_group)
        tokens = global_tokens.item()
        return {
            "rl/reward_mean": rewards_X.mean().item(),
            "rl/reward_std": rewards_X.std().item(),
            "rl/exact_match": (rewards_X == 1).float().mean().item(),
            "rl/advantage_mean": advantages_X.mean().item(),
            "rl/advantage_std": advantages_X.std().item(),
            "rl/advantage_min": advantages_X.min().item(),
            "rl/advantage_max": advantages_X.max().item(),
            "rl/kl": sums[0].item() / tokens,
            "rl/clip_fraction": sums[1].item() / tokens,
            "rl/kl_to_reference": sums[2].item() / tokens,
            "rl/completion_tokens": tokens,
            "rl/rollout_tokens_per_s": tokens / rollout_s,
            "rl/train_tokens_per_s": train_tps * self.dp_degree,  # all ranks (each trains as long)
            # the sampled tokens, their logprobs and rewards of every rank: equal values, equal rollouts
            "rl/rollout_digest": _as_float(hashlib.sha256("".join(digests).encode()).hexdigest()),
        }

    # ---- checkpointed state (TorchTitan saves it as "train_state") ----
    def state_dict(self) -> dict[str, Any]:
        state = {**super().state_dict(), "rl_prompt_index": self.prompt_index, "rl_seed": self.seed}
        if self.reference is not None:
            state["rl_reference"] = self.reference.state
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if state_dict["rl_seed"] != self.seed:
            raise ValueError(
                f"the checkpoint's RL run used [debug] seed = {state_dict['rl_seed']}, this run {self.seed}: "
                "a resumed run must keep the seed (its prompts and sampling streams derive from it)"
            )
        self.prompt_index = state_dict["rl_prompt_index"]
        if self.reference is not None:
            if "rl_reference" not in state_dict:
                raise ValueError(
                    "[rl] kl_coef > 0 but the checkpoint holds no reference policy (it was saved with kl_coef = 0)"
                )
            self.reference_restored = True  # DCP loaded into self.reference.state in place
