"""The scoring backend the settings ask for (shared by ``packscore serve`` and ``packscore score``)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

from service.settings import Settings


def model_name(settings: Settings) -> str:
    """The name a model is served under, as the loaded model will say it (a checkpoint directory's name, a preset's)."""
    return settings.served_model_name or Path(settings.model).name


def backend_loaders(settings: Settings) -> dict:
    """One loader per served model (``--model NAME=PATH`` repeated), keyed by served name; the
    key is None for a plain ``--model X``, named by ``--served-model-name`` or the model itself."""
    return {name: BackendLoader(settings.for_model(name, spec)) for name, spec in settings.model_specs().items()}


class BackendLoader:
    """Loads one served model's backend when called (in the service's load thread); ``abort()``, from
    another thread, closes a worker pool still starting: its loading workers must not outlive a
    server that exits meanwhile (a SIGTERM during the start)."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self._lock = threading.Lock()
        self._pool = None
        self._aborted = False

    @property
    def name(self) -> str:
        return model_name(self.settings)

    def __call__(self):
        if not self.settings.uses_worker_pool:
            return load_backend(self.settings)
        return load_backend(self.settings, starting=self._starting)

    def _starting(self, pool) -> None:
        with self._lock:
            self._pool, aborted = pool, self._aborted
        if aborted:
            pool.close()

    def abort(self) -> None:
        with self._lock:
            self._aborted, pool = True, self._pool
        if pool is not None:
            pool.close()


def load_backend(settings: Settings, starting: Callable | None = None):
    """The ScoringBackend the settings ask for: the worker pool, or the scorer in this process.
    ``starting(pool)``: called with the worker pool before its workers launch (to close it meanwhile)."""
    if settings.uses_worker_pool:
        from model_runtime.pool.pool import start_pool

        # The pool reads the prefix length in use (0: sharing off), as the scorer below does.
        return start_pool({**settings.model_dump(), "prefix_min_tokens": settings.prefix_min_tokens_in_use}, starting=starting)
    from model_runtime.scoring.backend import LocalBackend, favour_forward_threads
    from model_runtime.scoring.loading import load_model
    from model_runtime.scoring.scorer import Scorer

    favour_forward_threads()  # the forwards run beside the HTTP threads (or the reader's)

    loaded = load_model(
        settings.model,
        dtype=settings.dtype,
        device=None if settings.device == "auto" else settings.device,
        allow_slow_kernels=settings.allow_slow_kernels,
        kernel_overrides=settings.kernels,
        served_name=settings.served_model_name,
        expert_gemm=settings.expert_gemm,
    )
    scorer = Scorer(loaded, max_batch_tokens=settings.max_batch_tokens, prefix_min_tokens=settings.prefix_min_tokens_in_use)
    return LocalBackend(scorer, updates=settings.weights_root is not None)
