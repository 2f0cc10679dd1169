"""Tuning and A/B tools for kernel work (not installed). Run from the repository root, e.g.
``python -m benchmarks.tools.config_ab --help``."""
