"""packscore's model runtime: packed Qwen3.5 / Qwen3-Next scoring (importing this imports no torch).

- ``types``: the torch-free value types shared with the HTTP layer (``SequenceInput``, ``SequenceScores``).
- ``kernels/``: one boundary per kernel family, fast backends beside exact references.
- ``model/``: the packed model (packing metadata, packed layers, ``PackedCausalLM``).
- ``scoring/``: loading, the head, row planning, ``Scorer`` and the ``ScoringBackend`` surface.
- ``parallel/``: data, FSDP2 and Ulysses sequence parallelism on one node.
- ``pool/``: the multi-process worker pool.
"""
