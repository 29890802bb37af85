"""docs/weights.md's "A trainer's loop", run as written with the real client, its requests checked and
answered here instead of by a server: the calls it makes exist with those arguments, and the rollout's
log-probs go with the policy's scoring only (sent with ``ref`` they fill its rollout-mismatch
histograms with policy-to-reference figures, which are no training/inference drift)."""

import inspect
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np

import packscore_client
from packscore_client import ScoreClient
from packscore_client.protocol import ScoredSequence, WeightsUpdate

DOC = Path(__file__).resolve().parents[2] / "docs" / "weights.md"


def _loop() -> str:
    section = DOC.read_text().split("## A trainer's loop", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "docs/weights.md's trainer loop has no python block"
    return match.group(1)


class _Answered(ScoreClient):
    """The real client's checks of every call's sequences and options; no request sent."""

    calls: list = []

    def score(self, sequences, **options):
        inspect.signature(ScoreClient.score).bind(self, sequences, **options)
        seqs, opts, _, _ = self._plan(sequences, **{**_score_defaults(), **options})
        self.calls.append((opts.get("model"), [seq.rollout is not None for seq in seqs]))
        return [ScoredSequence(seq.id, np.zeros(len(seq.ids) - seq.score_from, np.float32), None, None, None,
                               opts.get("model"), options.get("weights_version") or "v",
                               None if seq.rollout is None else {"mean_abs_diff": 0.0, "max_abs_diff": 0.0,
                                                                  "k3_kl": 0.0})
                for seq in seqs]

    def update_weights(self, *args, **kwargs):
        bound = inspect.signature(ScoreClient.update_weights).bind(self, *args, **kwargs)
        return WeightsUpdate(bound.arguments["model"], bound.arguments.get("version") or "hash", "v0", 0.0, 0.0)


def _score_defaults() -> dict:
    params = inspect.signature(ScoreClient.score).parameters
    return {name: p.default for name, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}


def test_the_trainer_loop_sends_rollout_logprobs_with_the_policy_only(monkeypatch):
    monkeypatch.setattr(packscore_client, "ScoreClient", _Answered)
    monkeypatch.setattr(_Answered, "calls", [])
    rollouts = [SimpleNamespace(ids=[5, 6, 7, 8, 9], prompt_len=2, logprobs=[-0.5, -1.0, -0.25]),
                SimpleNamespace(ids=[5, 6, 11], prompt_len=2, logprobs=[-2.0])]
    trained = []
    namespace = {
        "steps": 2, "save_every": 1, "SCORE_KEY": "score-key", "ADMIN_KEY": "admin-key", "policy_engine": None,
        "generate": lambda engine: rollouts, "trainer": SimpleNamespace(save_pretrained=lambda path: None),
        "train_step": lambda **kwargs: trained.append(kwargs),
    }
    exec(compile(_loop(), str(DOC), "exec"), namespace)
    assert len(trained) == 2
    by_model = {}
    for model, rollout_sent in _Answered.calls:
        by_model.setdefault(model, []).extend(rollout_sent)
    assert set(by_model) == {"policy", "ref"}, _Answered.calls
    assert all(by_model["policy"]), "the policy's scoring does not send the rollout's log-probs"
    assert not any(by_model["ref"]), "the reference model is sent the rollout's log-probs"
