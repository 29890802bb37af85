"""``CheckpointError``: a checkpoint that must not be served, and how its messages quote names.

Raised by ``checkpoint_config`` (config.json) and ``checkpoint`` (the safetensors files), and
caught by the loader, the weight update and the service, which map ``kind`` to their answers.
"""

from __future__ import annotations

SHOWN = 5  # names quoted in a message
KINDS = ("unsupported", "incomplete", "incompatible", "unreadable", "non_finite")  # CheckpointError.kind, below


class CheckpointError(ValueError):
    """A checkpoint that must not be served. ``kind`` is one of:

    - ``"unsupported"``: a model_type, quantization or file format packscore does not load;
    - ``"incomplete"``: a tensor the model needs is missing, or a tensor in the files is unused;
    - ``"incompatible"``: a shape (or, against ``expected``, the architecture) differs;
    - ``"unreadable"``: a file that fails to read (truncated, corrupt, a config.json that is no JSON);
    - ``"non_finite"``: a weight holds NaN or infinity (it would score NaN for every token).
    """

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def quoted_names(items) -> str:
    items = list(items)
    shown = ", ".join(str(i) for i in items[:SHOWN])
    return shown + (f", ... and {len(items) - SHOWN} more" if len(items) > SHOWN else "")
