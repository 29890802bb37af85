"""Train/rollout mismatch: packscore's log-probs of the scored tokens against the rollout engine's."""

from __future__ import annotations

import numpy as np

_LARGEST = float(np.finfo(np.float32).max)
_ZERO = {name: np.float32(0.0) for name in ("mean_abs_diff", "max_abs_diff", "k3_kl")}


def mismatch(logprobs: np.ndarray, rollout: np.ndarray) -> dict[str, np.float32]:
    """``d = logprobs - rollout`` in float64 (both float32 ``[n_scored]``): mean and max ``|d|`` and
    ``k3_kl = mean(exp(d) - 1 - d)``, the k3 estimate of KL(rollout || served model) from the
    rollout's own samples, each a float32 as every number of the answer is (API.md), so that JSON
    prints it as it prints the log-probs (float32's shortest form). All zero for an empty scored range.

    >>> float(mismatch(np.array([-1.0], np.float32), np.array([-1.5], np.float32))["max_abs_diff"])
    0.5
    """
    if logprobs.shape != rollout.shape:
        raise ValueError(f"logprobs {logprobs.shape} and rollout {rollout.shape} must have one shape")
    if logprobs.size == 0:
        return dict(_ZERO)
    d = logprobs.astype(np.float64) - rollout.astype(np.float64)
    abs_d = np.abs(d)
    with np.errstate(over="ignore"):
        k3 = np.mean(np.expm1(d) - d)  # expm1: exact near d = 0, where exp(d) - 1 loses the digits
    # A rollout log-prob far below the model's overflows exp(d): JSON has no infinity, so a figure
    # past float32's range is its largest value, as log 0 is its lowest.
    figures = {"mean_abs_diff": abs_d.mean(), "max_abs_diff": abs_d.max(), "k3_kl": k3}
    return {name: np.float32(min(float(value), _LARGEST)) for name, value in figures.items()}
