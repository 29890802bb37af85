"""Scoring in one process: loading a model, planning packed rows, the log-probability head.

- ``presets``: named model configurations (``tiny`` and the Qwen3.5 sizes).
- ``loading``: ``load_model`` (checkpoint or preset, kernels chosen) -> ``LoadedModel``.
- ``head``: log-probabilities, entropy and top-k in token chunks.
- ``rows``: validating sequences, planning one packed row, splitting its results.
- ``scorer``: ``Scorer``, sequences in, per-sequence numpy arrays out.
- ``backend``: the ``ScoringBackend`` surface the service calls, and ``LocalBackend``.
"""
