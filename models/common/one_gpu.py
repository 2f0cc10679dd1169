"""What the four models' ``one_gpu`` flavors share: training on one 80 GB GPU (H100) with
full-width MoE layers, fewer layers and experts, and a cut vocabulary.

The published vocabularies (129k–248k tokens) put 1.9–2.3 B parameters into the embedding
and the output head: 30–38 GB of the 16 B/param a one-GPU run keeps (fp32 weights, fp32
gradients, AdamW's two fp32 moments), which would leave room for one MoE layer, and would make
the output head, a few percent of the published models' FLOPs, 40–70% of the small model's.
The embedded ``tasks`` corpus needs 128 token ids; 32768 keeps the head at the cost of a
typical small tokenizer's.
"""

VOCAB_SIZE = 32768
"""Vocabulary of every one_gpu flavor."""

TRAINING_BYTES_PER_PARAM = 16
"""fp32 weight + fp32 gradient + AdamW's two fp32 moments, per parameter (one GPU: nothing sharded)."""

GPU_BYTES = 80e9
"""The GPU the flavors are sized for (H100 80 GB; CUDA can allocate ~79 GiB of it)."""
