"""MXFP8 expert weights quantized once per weight version (``precision = "mxfp8"``, Triton expert FFN).

MXFP8 training reads each routed-expert weight in two layouts, the forward's and the dgrad's. The
weights change only where their storage is written in place: the optimizer step, a checkpoint load,
initialization. So each layout is quantized once per version of the weight it came from and kept
under its owner (the experts module): every microbatch of a step, every decode step of an RL rollout,
reads the same operand. A weight's version (``stamp``) is a count of optimizer steps and loads
(``weights_written``: titan-mok's trainers register it as an optimizer step post-hook, the
checkpointer calls it after a load) together with the source parameter's ``_version`` counter and
storage address, which in-place writes outside those bump. Both are needed: the fused AdamW update
(TorchTitan's default) writes the parameters without bumping ``_version``. Nothing is checkpointed:
after a load or resume the first use quantizes again, same bits.

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

# owner -> {(name, layout): (stamp, operand)}; weak, so a dropped model frees its operands
_kept: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_writes = 0  # optimizer steps and checkpoint loads so far


def weights_written(*_hook_args) -> None:
    """Every kept operand is stale: the optimizer stepped or a checkpoint loaded (an optimizer step
    post-hook: takes and ignores its arguments). Frees them; each is made again on its next use."""
    global _writes
    _writes += 1
    _kept.clear()


def stamp(source) -> tuple:
    """What identifies the values of ``source`` (a weight tensor) until it is written again."""
    return (_writes, source._version, source.data_ptr(), source.dtype, tuple(source.shape))


def operand(owner, name: str, layout, source_stamp: tuple, make):
    """``make()``'s operand for (owner, name, layout), made again only when ``source_stamp`` differs
    from the one it was made at. ``layout``: which quantization of the weight (e.g. the ``along`` of
    ``grouped_ffn.weight_operand``). ``owner`` None: ``make()`` every time (nothing kept)."""
    if owner is None:
        return make()
    kept = _kept.setdefault(owner, {})
    entry = kept.get((name, layout))
    if entry is None or entry[0] != source_stamp:
        kept[(name, layout)] = entry = (source_stamp, make())
    return entry[1]

