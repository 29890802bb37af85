"""An update in place whose checkpoint's files change while they are copied: the refusal names the
checkpoint's whole path, as every other refusal of an update does (two roots may both hold a ``step-120``)."""

import copy

import pytest

import model_runtime.scoring.weights as weights
from model_runtime.scoring.backend import LocalBackend
from model_runtime.scoring.checkpoint_error import CheckpointError
from model_runtime.scoring.loading import load_model
from model_runtime.scoring.scorer import Scorer
from tests.checkpoints import save_checkpoint


@pytest.mark.parametrize("copy_back", [True, False], ids=["copied-back", "nothing-to-copy-back"])
def test_files_changed_during_the_copy_in_place_are_named_by_the_checkpoints_whole_path(
        checkpoint_dir, tmp_path, monkeypatch, copy_back):
    path = save_checkpoint("qwen3_5", tmp_path / "root-b" / "step-120", seed=1)
    backend = LocalBackend(Scorer(copy.deepcopy(load_model(str(checkpoint_dir("qwen3_5")), device="cpu"))))
    backend.update_in_place = True
    if not copy_back:
        backend._served_from = None  # as for a preset's weights
    real = weights.read_parameters

    def copy_then_rewrite(*args, **kwargs):
        out = real(*args, **kwargs)
        if kwargs.get("into_model") and not copied:  # the new checkpoint's copy, not the copy back
            copied.append(True)
            shard = next(path.glob("*.safetensors"))
            shard.write_bytes(shard.read_bytes())  # the same bytes, written again: a new modification time
        return out

    copied: list[bool] = []
    monkeypatch.setattr(weights, "read_parameters", copy_then_rewrite)
    with pytest.raises(CheckpointError) as caught:
        backend.update_weights(path, None)
    said = str(caught.value)
    assert copied and caught.value.kind == "unreadable", said
    assert said.startswith(f"checkpoint {path}: its files changed while they were copied in place"), said
    assert "model.safetensors" in said, said  # the file that changed, as the refusal of a read names it
