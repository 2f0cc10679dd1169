"""Benchmark scripts and tools kept beside the package, not installed with it (benchmarks/tools)."""
