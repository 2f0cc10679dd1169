"""Gated DeltaNet on a GPU: flash-linear-attention's Triton ``chunk_gated_delta_rule``
against our pure-PyTorch chunked form (same inputs), agreement and speed.

    python -m benchmarks.tools.deltanet [--seq-len 4096]

Shape: one Qwen3.5-397B-A17B DeltaNet layer (16 q/k heads, 64 value heads, head
dims 128), BF16 inputs. Agreement: relative RMS error of the output and of every
input gradient, ours (fp32 math) as the reference. Times: median of
``triton.testing.do_bench``, both measured in the same process.

fla-core 0.6.0 refuses its backward (``chunk_bwd_dqkwg``) on Hopper with Triton
< 3.7.1 (wrong results, FLA issue #640); the H200 machine has Triton 3.6, so
there only the forward is compared and the gradients are reported as not run.
"""

import argparse

import torch

from titan_mok.models.qwen3_5_397b_a17b.gated_deltanet import chunk_gated_delta_rule


def rms_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt()).item()


def make_inputs(seq_len: int, batch: int = 1, hk: int = 16, hv: int = 64, dk: int = 128, dv: int = 128):
    g = torch.Generator(device="cuda").manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(batch, seq_len, hk, dk, generator=g, **bf16)
    k = torch.randn(batch, seq_len, hk, dk, generator=g, **bf16)
    v = torch.randn(batch, seq_len, hv, dv, generator=g, **bf16)
    # decay as the model makes it: -exp(A_log)·softplus(a + dt_bias), A in [1, 16]
    a = torch.randn(batch, seq_len, hv, generator=g, device="cuda")
    gate = -torch.empty(hv, device="cuda").uniform_(1, 16) * torch.nn.functional.softplus(a + 1.0) / 16
    beta = torch.rand(batch, seq_len, hv, generator=g, device="cuda").to(torch.bfloat16)
    return [t.requires_grad_() for t in (q, k, v, gate.float(), beta)]


def main():
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    from triton.testing import do_bench

    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, default=4096)
    seq_len = parser.parse_args().seq_len

    def ours(q, k, v, g, beta):
        return chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64)

    def theirs(q, k, v, g, beta):
        return fla_chunk(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]

    inputs = make_inputs(seq_len)
    with torch.no_grad():
        print(f"agreement o (forward): relative RMS error fla vs ours = {rms_rel(theirs(*inputs), ours(*inputs)):.3e}")
    for name, fn in (("ours", ours), ("fla", theirs)):
        fwd_ms = do_bench(lambda: fn(*inputs), warmup=5, rep=50, return_mode="median")
        print(f"time {name}: forward {fwd_ms:.3f} ms (B=1, S={seq_len}, Hk=16, Hv=64, D=128, bf16)")

    grads = {}
    for name, fn in (("ours", ours), ("fla", theirs)):
        xs = [x.detach().clone().requires_grad_() for x in inputs]
        o = fn(*xs)
        try:
            o.backward(torch.ones_like(o))
        except RuntimeError as err:  # FLA refuses its backward on Hopper with Triton < 3.7.1 (FLA #640)
            print(f"{name} backward not run: {err}")
            return
        grads[name] = [x.grad for x in xs]

        def fwd_bwd():
            fn(*xs).backward(torch.ones_like(o))

        print(f"time {name}: forward+backward {do_bench(fwd_bwd, warmup=5, rep=50, return_mode='median', grad_to_none=xs):.3f} ms")
    for label, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), grads["fla"], grads["ours"]):
        print(f"agreement {label}: relative RMS error fla vs ours = {rms_rel(a, b):.3e}")


if __name__ == "__main__":
    main()
