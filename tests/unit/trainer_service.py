"""What the trainer-service tests share (test_trainer_service_*.py, test_rollout_mismatch.py): the
sequence they score, the keys, two fake models, a weights root with two checkpoints, and the
log-probs the fake backend gives."""

import numpy as np

from model_runtime.types import SequenceInput
from service.testing import FakeBackend, expected_scores

SEQ = {"id": "a", "input_ids": [1, 2, 3, 4], "score_from": 2}
KEY, ADMIN = "score-key", "admin-key"


def two_models(**fake):
    return {"policy": FakeBackend(name="policy-ckpt", **fake), "ref": FakeBackend(name="ref-ckpt", vocab_size=500)}


def score_body(body: dict, **extra) -> dict:
    return {"sequences": [SEQ], **extra, **body}


def expected_logprobs(seq: dict, generation: int = 0) -> np.ndarray:
    return expected_scores(SequenceInput(np.array(seq["input_ids"]), seq["score_from"]), generation).logprobs


def make_weights_root(tmp_path):
    root = tmp_path / "root"
    for step in ("step-1", "step-2"):
        (root / step).mkdir(parents=True)
        (root / step / "model.safetensors").write_bytes(step.encode())
    return root
