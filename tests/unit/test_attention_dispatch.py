"""The attention layer's hand-over to a backend that also takes the rotary embedding and the
output gate (``rope_and_gate``: ``sdpa_fused``'s on CUDA, model_runtime/model/layers.py). On the
CPU a stand-in that runs Hugging Face's steps itself must give the layer's own numbers bit for
bit (so the layer hands over the right tensors: q and k before the rotary, the gate, the row),
and a stand-in that declines (None) must leave the steps one by one to the layer."""

import numpy as np
import pytest
import torch

from model_runtime.kernels import elementwise as E
from model_runtime.kernels.attention import ROPE_AND_GATE, causal_attention_reference
from model_runtime.scoring.loading import load_model
from model_runtime.scoring.scorer import Scorer
from model_runtime.types import SequenceInput


def _steps(q, k, v, cos, sin, gate, packed, scale):
    rq, rk = E.EAGER.partial_rope(q, k, cos, sin)
    return (causal_attention_reference(rq, rk, v, packed, scale) * torch.sigmoid(gate)).reshape(q.shape[0], -1)


def _with_hand_over(monkeypatch, fn):
    def attention(q, k, v, packed, scale):
        return causal_attention_reference(q, k, v, packed, scale)

    monkeypatch.setitem(ROPE_AND_GATE, attention, fn)
    return attention


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_rope_and_gate_hand_over_keeps_the_numbers(kind, checkpoint_dir, monkeypatch):
    loaded = load_model(str(checkpoint_dir(kind)), device="cpu")
    layers = [m for m in loaded.model.modules() if type(m).__name__ == "PackedAttention"]
    assert layers, "the checkpoint has no full-attention layer"
    rng = np.random.default_rng(3)
    seqs = [SequenceInput(rng.integers(0, loaded.vocab_size, n), score_from=1) for n in (1, 7, 40, 3)]
    want = Scorer(loaded).score_row(seqs)
    calls = {"taken": 0, "declined": 0}

    def taking(*args):
        calls["taken"] += 1
        return _steps(*args)

    def declining(*args):
        calls["declined"] += 1
        return None

    for fn, key in ((taking, "taken"), (declining, "declined")):
        for layer in layers:
            layer.attention_fn = _with_hand_over(monkeypatch, fn)
        got = Scorer(loaded).score_row(seqs)
        assert calls[key] == len(layers), f"{key}: the layers called the hand-over {calls[key]} times, not {len(layers)}"
        for a, b in zip(got, want):
            assert np.array_equal(a.logprobs, b.logprobs) and np.array_equal(a.entropy, b.entropy), (
                f"{key}: log-probs moved by {np.abs(a.logprobs - b.logprobs).max():.3e} (tolerance 0)")
