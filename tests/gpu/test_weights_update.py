"""Weight updates on CUDA (bf16): beside the old weights and in place, against a fresh load."""

import numpy as np
import pytest
import torch

from model_runtime.scoring.backend import LocalBackend
from model_runtime.scoring.loading import load_model
from model_runtime.scoring.scorer import Scorer
from model_runtime.scoring.content_hash import content_version
from model_runtime.types import SequenceInput
from tests.checkpoints import save_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("in_place", [False, True], ids=["beside", "in-place"])
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_an_update_on_cuda_equals_a_fresh_load(kind, in_place, tmp_path):
    old = save_checkpoint(kind, tmp_path / "old", seed=0)
    new = save_checkpoint(kind, tmp_path / "new", seed=1)
    backend = LocalBackend(Scorer(load_model(str(old), device="cuda")))
    backend.update_in_place = in_place
    fresh = Scorer(load_model(str(new), device="cuda"))
    rng = np.random.default_rng(0)
    row = [SequenceInput(rng.integers(0, backend.info.vocab_size, n), score_from=1) for n in (5, 40, 200)]
    update = backend.update_weights(new, "v2")
    params = list(backend.scorer.loaded.model.parameters())
    assert all(p.dtype == torch.bfloat16 and p.is_cuda for p in params)
    got, want = backend.score_row(row), fresh.score_row(row)
    for j, (a, b) in enumerate(zip(got, want)):
        diff = float(np.abs(a.logprobs - b.logprobs).max())
        assert a.weights_version == "v2"
        assert diff == 0.0, f"{kind} sequence {j}: max |diff| {diff:.3e} against a fresh load, want bit for bit"
    assert update.weights_version == "v2" and backend.info.weights_version == "v2"


def test_an_update_beside_allocates_no_page_locked_memory_once_staging_exists(tmp_path):
    """Allocating page-locked memory holds up every CUDA call of the process, a serving loop's
    too: updates beside the old weights stream through the process's staging slots, made once."""
    old = save_checkpoint("qwen3_5_moe", tmp_path / "old", seed=0)
    new = save_checkpoint("qwen3_5_moe", tmp_path / "new", seed=1)
    backend = LocalBackend(Scorer(load_model(str(old), device="cuda")))
    backend.update_in_place = False
    backend.update_weights(new, "v2")  # the first update may make the staging slots
    torch.cuda.synchronize()
    before = torch.cuda.host_memory_stats()["num_host_alloc"]
    backend.update_weights(old, "v3")
    hashed = backend.update_weights(new, None)  # the content hash, of the bytes the slots carried
    torch.cuda.synchronize()
    grown = torch.cuda.host_memory_stats()["num_host_alloc"] - before
    assert grown == 0, f"{grown} page-locked allocations during two updates, want none"
    assert hashed.weights_version == content_version(new), (hashed.weights_version, content_version(new))
    fresh = dict(load_model(str(new), device="cuda").model.named_parameters())
    differ = [n for n, p in backend.scorer.loaded.model.named_parameters() if not torch.equal(p, fresh[n])]
    assert not differ, f"{len(differ)} parameters differ from a fresh load: {differ[:5]}"


def test_a_backend_that_may_update_makes_its_staging_slots_before_the_first_update(tmp_path):
    """With --weights-root the slots are made with the backend, so that even a process's first
    update allocates no page-locked memory beside the forwards."""
    from model_runtime.scoring import tensor_file

    old = save_checkpoint("qwen3_5", tmp_path / "old", seed=0)
    new = save_checkpoint("qwen3_5", tmp_path / "new", seed=1)
    with tensor_file._staging_lock:
        tensor_file._staging.clear()  # as in a fresh process
    backend = LocalBackend(Scorer(load_model(str(old), device="cuda")), updates=True)
    backend.update_in_place = False
    made = dict(tensor_file._staging)
    assert len(made) == 1, f"staging made with the backend: {list(made)}"
    torch.cuda.synchronize()
    before = torch.cuda.host_memory_stats()["num_host_alloc"]
    backend.update_weights(new, "v2")
    torch.cuda.synchronize()
    grown = torch.cuda.host_memory_stats()["num_host_alloc"] - before
    assert grown == 0, f"{grown} page-locked allocations in the first update, want none"
    assert tensor_file._staging == made, f"the update made its own staging: {list(tensor_file._staging)}"


def test_a_staging_slot_is_filled_again_only_once_its_copy_is_done(tmp_path):
    """One slot of 4 KiB, and the side stream held up by a sleeping kernel before the first copy:
    a tensor of hundreds of slots arrives whole only if each refill waited for the copy out of
    the slot, the reference being the tensor itself."""
    from safetensors.torch import save_file

    from model_runtime.scoring.tensor_file import Staging, TensorFile

    t = torch.randn(1000, 257, generator=torch.Generator().manual_seed(0))
    save_file({"w": t}, str(tmp_path / "w.safetensors"))
    staging = Staging(torch.device("cuda"), count=1, size=4096)
    out = torch.zeros(t.numel() * 4, dtype=torch.uint8, device="cuda")
    with TensorFile(tmp_path / "w.safetensors") as f, torch.cuda.stream(staging.stream):
        torch.cuda._sleep(200_000_000)  # tens of milliseconds of the side stream busy
        f.read_into(out, "w", staging=staging)
    staging.stream.synchronize()
    got = out.view(torch.float32).view(1000, 257).cpu()
    assert torch.equal(got, t), f"{int((got != t).sum())} of {t.numel()} values differ: a slot was refilled under its copy"
