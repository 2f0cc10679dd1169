"""MXFP8 expert weights quantized once per weight version (``precision = "mxfp8"``, Triton expert FFN).

MXFP8 training reads each routed-expert weight in two layouts, the forward's and the dgrad's. The
weights change only where their storage is written in place: the optimizer step, a checkpoint load,
initialization. So each layout is quantized once per version of the weight it came from and kept
under its owner (the experts module): every microbatch of a step, every decode step of an RL rollout,
reads the same operand. The version is the source parameter's ``_version`` counter and storage
address (``stamp``): any in-place write bumps the counter, so a stale operand is never read, and
nothing is checkpointed (after a load or resume the first use quantizes again, same bits).

Memory: an MXFP8 copy of the local expert weights per layout kept, 1 byte per element plus one E8M0
scale per 32 (~1.03 bytes per element, 0.52x the bf16 weights per layout), held from the first use
on. Under FSDP the weights an expert forward reads are gathered again every forward, so there is no
version to key on here: the caller passes no owner and each pass quantizes (docs/design.md).
"""

import weakref

# owner -> {(name, along): (stamp, operand)}; weak, so a dropped model frees its operands
_kept: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def stamp(source) -> tuple:
    """What identifies the values of ``source`` (a weight tensor) until it is written in place."""
    return (source._version, source.data_ptr(), source.dtype, tuple(source.shape))


def operand(owner, name: str, along: int, source_stamp: tuple, make):
    """``make()``'s operand for (owner, name, along), made again only when ``source_stamp`` differs
    from the one it was made at. ``owner`` None: ``make()`` every time (nothing kept)."""
    if owner is None:
        return make()
    kept = _kept.setdefault(owner, {})
    entry = kept.get((name, along))
    if entry is None or entry[0] != source_stamp:
        kept[(name, along)] = entry = (source_stamp, make())
    return entry[1]


def drop(owner) -> None:
    """Forget ``owner``'s operands (e.g. to free their memory); the next use quantizes again."""
    _kept.pop(owner, None)
