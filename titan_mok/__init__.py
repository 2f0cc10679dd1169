"""titan-mok: MoK-style deterministic MoE training on TorchTitan."""
