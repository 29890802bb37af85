"""The packed model: Hugging Face's Qwen3.5 / Qwen3-Next modules switched to packed THD rows.

- ``architectures``: the supported model types and their layer kinds.
- ``packing``: ``PackedBatch`` (one row's segment metadata) and first-fit-decreasing packing.
- ``layers``: the packed Gated DeltaNet and full-attention mixers.
- ``causal_lm``: ``PackedCausalLM`` and ``patch_for_packing``.
"""
