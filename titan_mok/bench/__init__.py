"""Benchmarks a user runs: the MoE layer against TorchTitan's own (layer), training end to end (e2e).
Numbers and commands: docs/performance.md."""
