"""docs/client.md's trainer recipe, run as written against a real server: a verl-style padded batch
of numpy arrays -> reference log-probs aligned with the response mask -> the k3 KL."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from model_runtime.types import SequenceInput
from tests.e2e.helpers import API_KEY, TINY_VOCAB, TOL

DOC = Path(__file__).resolve().parents[2] / "docs" / "client.md"


def recipe() -> str:
    """The python block that follows the ``<!-- recipe`` marker in docs/client.md."""
    text = DOC.read_text()
    match = re.search(r"<!-- recipe[^>]*-->\s*```python\n(.*?)```", text, re.S)
    assert match, "docs/client.md has no recipe block"
    return match.group(1)


def verl_batch(rng: np.random.Generator, prompts: list[int], responses: list[int], pad_id: int = 0) -> dict:
    """Prompts left-padded to the longest, responses right-padded, as verl's rollout writes them."""
    P, R = max(prompts), max(responses)
    batch = {"input_ids": np.full((len(prompts), P + R), pad_id, np.int64),
             "attention_mask": np.zeros((len(prompts), P + R), np.int64),
             "response_mask": np.zeros((len(prompts), R), np.int64)}
    for b, (p, r) in enumerate(zip(prompts, responses)):
        batch["input_ids"][b, P - p : P + r] = rng.integers(1, TINY_VOCAB, p + r)
        batch["attention_mask"][b, P - p : P + r] = 1
        batch["response_mask"][b, :r] = 1
    return batch


def test_the_documented_recipe_runs_as_written(tiny_server, tiny_scorer, monkeypatch):
    rng = np.random.default_rng(21)
    prompts, responses = [7, 3, 12, 5, 9], [10, 4, 1, 13, 6]
    batch = verl_batch(rng, prompts, responses)
    batch["response_mask"][3, 5:8] = 0  # a masked span inside a response (a tool's output)
    P, mask = max(prompts), batch["response_mask"].astype(bool)

    # What the server must answer: each row alone, without its pads, in this process.
    want = np.zeros(mask.shape, np.float32)
    want_entropy = np.zeros(mask.shape, np.float32)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        ids = batch["input_ids"][b, P - p : P + r]
        (s,) = tiny_scorer.score([SequenceInput(ids, p, 1.0, 0, True)])
        want[b, :r], want_entropy[b, :r] = s.logprobs, s.entropy
    want[~mask] = want_entropy[~mask] = 0
    old_log_prob = np.where(mask, want + rng.normal(0, 0.1, mask.shape), 0).astype(np.float32)

    monkeypatch.setenv("PACKSCORE_URL", tiny_server.url)
    monkeypatch.setenv("PACKSCORE_API_KEY", API_KEY)
    scope = {"batch": batch, "old_log_prob": old_log_prob}
    exec(compile(recipe(), str(DOC), "exec"), scope)

    got, got_entropy = scope["ref_log_prob"], scope["ref_entropy"]
    assert got.shape == mask.shape and got.dtype == np.float32
    diff = float(np.max(np.abs(got - want)))
    assert diff <= TOL, f"reference log-probs: max |diff| {diff} > {TOL}"
    diff = float(np.max(np.abs(got_entropy - want_entropy)))
    assert diff <= TOL, f"entropy: max |diff| {diff} > {TOL}"
    assert not got[~mask].any() and not got_entropy[~mask].any(), "non-zero where response_mask is 0"
    delta = want - old_log_prob
    kl = float((np.clip(np.exp(delta) - delta - 1, -10, 10) * mask).sum() / mask.sum())
    assert abs(scope["kl"] - kl) <= 1e-5, (scope["kl"], kl)
    assert scope["kl"] > 0
