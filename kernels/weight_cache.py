"""Quantized expert weights kept for one optimizer step (``[mok] mxfp8_weight_cache``).

MXFP8 training quantizes each routed-expert weight in two layouts per micro-batch, the forward's and
the dgrad's: at Kimi K2.7's EP=2 size ~15 ms per layer on an H200, about as long as the layer's
GEMMs. Within one optimizer step the weights do not change, so with gradient
accumulation every micro-batch after the first can reuse the first one's, and an RL rollout's
decode steps all read the same weights. ``kept_for_step()`` scopes that reuse to the block it wraps
(the pretraining trainer wraps each ``train_step``, the RL trainer each rollout); outside it nothing
is kept.

Memory: while the scope is open, an MXFP8 copy of every local expert weight in each layout it was
used in, ~1 byte per element per layout: together as much as the bf16 weights. Under FSDP those are
copies of the gathered weights, which FSDP would otherwise free after each use.
"""

import contextlib

_kept: dict | None = None  # (owner, name, along) -> operand, while a scope is open


@contextlib.contextmanager
def kept_for_step(enabled: bool = True):
    """Within this block, ``operand`` makes each (owner, name, along) operand once (not ``enabled``:
    nothing is kept, the configured-off case). The caller promises that no weight changes inside it
    (one optimizer step: the optimizer runs after the last backward)."""
    global _kept
    if not enabled:
        yield
        return
    if _kept is not None:
        raise RuntimeError("kept_for_step() is already open: one optimizer step at a time")
    _kept = {}
    try:
        yield
    finally:
        _kept = None


def operand(owner, name: str, along: int, make):
    """``make()``, or inside ``kept_for_step()`` the operand an earlier call made for the same
    (owner, name, along) in this scope. ``owner`` (e.g. the experts module) is held until the scope
    ends, so its identity cannot pass to another object meanwhile."""
    if _kept is None or owner is None:
        return make()
    key = (owner, name, along)
    if key not in _kept:
        _kept[key] = make()
    return _kept[key]
