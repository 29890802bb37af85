"""Where compiled kernels are kept, so a restart finds them instead of compiling again.

Three caches matter for start-up: Triton's (fla's kernels and their autotuning results, the
fused head), TorchInductor's (the fused elementwise functions: FX graphs and their Triton
kernels) and fla's own tensor caches (in memory only). ``configure_kernel_cache(path)`` points
the first two into one directory; call it before any kernel is compiled (in ``main()``, before
the model loads). Explicit environment settings win. ``packscore_cache_dir()`` is packscore's own
cache (the prefix-rounding tables, the experts' CUTLASS library).
"""

from __future__ import annotations

import os
from pathlib import Path


def configure_kernel_cache(path: str | os.PathLike) -> dict[str, str]:
    """Sets ``TRITON_CACHE_DIR=path`` and ``TORCHINDUCTOR_CACHE_DIR=path/inductor`` unless set.

    Returns the two directories in use. A warm directory turns the fla autotuning and the
    Inductor compilation of ``Scorer.warm_up`` into cache reads.
    """
    root = Path(path).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TRITON_CACHE_DIR", str(root))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    return {"triton": os.environ["TRITON_CACHE_DIR"], "inductor": os.environ["TORCHINDUCTOR_CACHE_DIR"]}


def packscore_cache_dir() -> Path:
    """``$PACKSCORE_CACHE_DIR``, else ``$XDG_CACHE_HOME/packscore`` (the image points it at its
    writable /cache volume), else ``~/.cache/packscore``."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(os.environ.get("PACKSCORE_CACHE_DIR") or (Path(xdg) if xdg else Path.home() / ".cache") / "packscore")
