"""MXFP8 expert weights quantized once per weight version (``precision = "mxfp8"``, Triton expert FFN).

MXFP8 training reads each routed-expert weight in two layouts, the forward's and the dgrad's. The
weights change only where their storage is written in place: the optimizer step, a checkpoint load,
initialization. So each layout is quantized once per version of the weight it came from and kept
under its owner (the experts module): every microbatch of a step, every decode step of an RL rollout,
reads the same operand. A weight's version (``stamp``) is a count of optimizer steps and loads
(``step_post_hook``, titan-mok's trainers' optimizer step post-hook; ``weights_written``, called
by the checkpointer after a load) together with the source parameter's ``_version`` counter and
storage address, which in-place writes outside those bump. Both are needed: the fused AdamW update
(TorchTitan's default) writes the parameters without bumping ``_version``. Nothing is checkpointed:
after a load or resume the first use quantizes again, same bits.

Where the quantization runs: in the optimizer step. ``step_post_hook`` makes every kept layout again
right after the update, from its source weight (each caller hands ``operand`` a ``remake`` that reads
the source, not the cast it was given), so no forward or backward of the next step quantizes; one
layout's stale copy is freed before its fresh one is made, so the step's peak memory is the kept
copies' plus one layout. After a load or an RL policy swap (``weights_written``) they are made again
lazily, at their first use.

Memory: an MXFP8 copy of the local expert weights per layout kept, 1 byte per element plus one E8M0
scale per 32 (~1.03 bytes per element, 0.52x the bf16 weights per layout), held from the first use
on. Under FSDP (and so under EP) the same holds for each rank's shard instead: each rank keeps the
MXFP8 layouts of its own shard, made from the shard cast to FSDP's ``param_dtype``, and FSDP
all-gathers those (``titan_mok/moe/mxfp8_fsdp.py``), so the FFN, reference and Triton kernels alike,
receives MXFP8 operands and quantizes nothing (~1.03 bytes per shard element per layout kept; the
gathered operands live only while FSDP holds the layer unsharded). The gathered tensors themselves
identify nothing (their ``_version`` stays 0, their address repeats), so nothing is kept for them.
"""

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class _Kept:
    stamp: tuple
    operand: object
    remake: Callable[[], tuple] | None
    """() -> (stamp, operand) read from the source weight itself (for ``step_post_hook``); None: dropped there."""


# owner -> {(name, layout): _Kept}; weak, so a dropped model frees its operands
_kept: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_writes = 0  # optimizer steps and checkpoint loads so far


def weights_written(*_hook_args) -> None:
    """Every kept operand is stale: a checkpoint loaded, or the weights were swapped (the RL reference
    policy). Frees them; each is made again at its next use. Takes and ignores any arguments."""
    global _writes
    _writes += 1
    _kept.clear()


def step_post_hook(models) -> Callable:
    """The optimizer step post-hook for the optimizer of ``models`` (modules, or one): after each update
    the kept operands of their submodules are made again from the fresh source weights, bitwise what their
    next use would make; any other kept operand (another model's, one without a ``remake``) is stale and
    freed, made at its next use."""
    models = [models] if isinstance(models, torch.nn.Module) else list(models)

    def weights_stepped(*_hook_args) -> None:
        global _writes
        _writes += 1
        owners = {m for model in models for m in model.modules()}
        with torch.no_grad():
            for owner, kept in list(_kept.items()):
                for key in list(kept):
                    remake = kept.pop(key).remake  # the stale copy goes before the fresh one is made
                    if remake is not None and owner in owners:
                        kept[key] = _Kept(*remake(), remake)

    return weights_stepped


def stamp(source) -> tuple:
    """What identifies the values of ``source`` (a weight tensor) until it is written again."""
    return (_writes, source._version, source.data_ptr(), source.dtype, tuple(source.shape))


def operand(owner, name: str, layout, source_stamp: tuple, make, remake: Callable[[], tuple] | None = None):
    """``make()``'s operand for (owner, name, layout), made again only when ``source_stamp`` differs
    from the one it was made at. ``layout``: which quantization of the weight (e.g. the ``along`` of
    ``grouped_ffn.weight_operand``). ``owner`` None: ``make()`` every time (nothing kept). ``remake``:
    () -> (the source's stamp, the operand), both read from the source weight at the time of the call
    (``step_post_hook`` runs it after each optimizer step)."""
    if owner is None:
        return make()
    kept = _kept.setdefault(owner, {})
    entry = kept.get((name, layout))
    if entry is None or entry.stamp != source_stamp:
        kept.pop((name, layout), None)  # the stale copy goes before the fresh one is made
        kept[(name, layout)] = entry = _Kept(source_stamp, make(), remake)
    return entry.operand

