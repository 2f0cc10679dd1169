"""Triton kernels for Hopper, each beside its PyTorch reference (installed as ``titan_mok.kernels``)."""
