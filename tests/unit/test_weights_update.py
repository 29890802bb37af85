"""Weight updates in one process: the checkpoint-to-parameter mapping, the swap and failed updates."""

import copy
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from model_runtime.scoring.backend import LocalBackend
from model_runtime.scoring.checkpoint_error import CheckpointError
from model_runtime.scoring.loading import load_model
from model_runtime.scoring.scorer import Scorer
from model_runtime.scoring.content_hash import content_version
from model_runtime.scoring.weights import plan_reads, read_parameters, swap_parameters
from model_runtime.types import SequenceInput
from tests.checkpoints import HostStaging, save_checkpoint


@pytest.fixture(scope="module")
def second(tmp_path_factory):
    """kind -> a second tiny checkpoint of that kind with other weights (seed 1)."""
    cache = {}

    def get(kind: str) -> Path:
        if kind not in cache:
            cache[kind] = save_checkpoint(kind, tmp_path_factory.mktemp(f"{kind}-seed1"), seed=1)
        return cache[kind]

    return get


@pytest.fixture(scope="module")
def served(checkpoint_dir):
    """A fresh backend serving the seed-0 qwen3_5 checkpoint (a copy of one loaded model)."""
    loaded = load_model(str(checkpoint_dir("qwen3_5")), device="cpu")
    return lambda: LocalBackend(Scorer(copy.deepcopy(loaded)))


@pytest.fixture(scope="module")
def reference_new(second):
    """A scorer that loaded the seed-1 checkpoint at start."""
    return Scorer(load_model(str(second("qwen3_5")), device="cpu"))


def rows(vocab: int, count: int, seed: int = 0) -> list[list[SequenceInput]]:
    rng = np.random.default_rng(seed)
    return [
        [SequenceInput(rng.integers(0, vocab, int(n)), score_from=1, top_k=i % 2) for n in rng.integers(2, 24, 1 + i % 2)]
        for i in range(count)
    ]


def assert_equal(got, want, where: str) -> None:
    for j, (a, b) in enumerate(zip(got, want)):
        diff = float(np.abs(a.logprobs - b.logprobs).max()) if a.logprobs.size else 0.0
        assert np.array_equal(a.logprobs, b.logprobs), f"{where} sequence {j}: max |diff| {diff:.3e}, want exactly equal"
        assert np.array_equal(a.entropy, b.entropy), f"{where} sequence {j}: entropies differ"


def test_every_kind_reads_the_parameters_from_pretrained_builds(kind, checkpoint_dir, second):
    """Names, prefixes (multimodal) and fused experts (MoE) map exactly as Hugging Face's load does."""
    served = load_model(str(checkpoint_dir(kind)), device="cpu")
    fresh = load_model(str(second(kind)), device="cpu")
    plan = plan_reads(served.model, second(kind))
    swap_parameters(served.model, read_parameters(served.model, plan))
    want = dict(fresh.model.named_parameters())
    differ = [n for n, p in served.model.named_parameters() if not torch.equal(p, want[n])]
    assert not differ, f"{len(differ)} parameters differ from a fresh load: {differ[:5]}"


@pytest.mark.parametrize("rank", [None, (0, 2), (1, 2), (2, 3)])
def test_positioned_reads_equal_the_mapped_reads(kind, second, rank):
    """The path of an update beside the old weights (``_read_positioned``, through staging slots as
    on a GPU) reads every parameter, a rank's rows of it included, as the mapping does: whole
    tensors, row slices, stacked experts and gate/up pairs."""
    from model_runtime.scoring.tensor_file import TensorFile
    from model_runtime.scoring.weights import _MappedFile, _read_positioned, _read_rows, held_parameters

    path = second(kind)
    served = load_model(str(path), device="cpu")
    plan = plan_reads(served.model, path)
    (file,) = path.glob("*.safetensors")
    staging = HostStaging(2, 4099)
    with TensorFile(file) as positioned, _MappedFile(file) as mapped:
        for r in plan.reads:
            if rank is None:
                rows = None
            else:
                per = -(-r.shape[0] // rank[1])
                rows = slice(min(rank[0] * per, r.shape[0]), min((rank[0] + 1) * per, r.shape[0]))
            want = _read_rows(r, dict.fromkeys(mapped.keys(), mapped), rows)
            for through in (staging, None):
                got = _read_positioned(r, dict.fromkeys(positioned.keys(), positioned), rows, torch.device("cpu"), through)
                assert got.dtype == want.dtype or want.numel() == 0, f"{r.param}: {got.dtype}, mapped {want.dtype}"
                assert got.shape == want.shape and torch.equal(got.to(want.dtype), want), (
                    f"{r.param} ({r.combine}) rows {rows}: positioned {list(got.shape)} differs from mapped {list(want.shape)}")
    assert set(held_parameters(served.model)) == {r.param for r in plan.reads}


@pytest.mark.parametrize("piece, slot", [(None, None), (1000, 333), (4096, 4096)])
def test_the_content_hash_of_the_bytes_read_is_the_content_version(kind, second, tmp_path, piece, slot):
    """An update with no version hashes the tensors as it reads them (in any cuts: whole, or
    through staging slots that do not divide the hash's pieces) and reads only the rest (a vision
    tower, ``mtp.*``) again: the version is the one ``content_version`` gives on its own."""
    from model_runtime.scoring.tensor_file import TensorFile
    from model_runtime.scoring.content_hash import CONTENT_PIECE
    from model_runtime.scoring.weights import ReadDigests, _read_positioned
    from tests.checkpoints import rewrite_checkpoint

    path = rewrite_checkpoint(second(kind), tmp_path / "ck", lambda t: {**t, "mtp.fc.weight": torch.ones(3, 5)})
    served = load_model(str(path), device="cpu")
    plan = plan_reads(served.model, path)
    piece = piece or CONTENT_PIECE
    digests = ReadDigests(piece)
    if slot is None:
        read_parameters(served.model, plan, digests=digests)
    else:
        (file,) = path.glob("*.safetensors")
        with TensorFile(file) as f:
            for r in plan.reads:
                _read_positioned(r, dict.fromkeys(f.keys(), f), None, torch.device("cpu"), HostStaging(2, slot), digests)
    assert "mtp.fc.weight" not in digests.tensors and digests.tensors
    want = content_version(path, piece=piece)
    assert content_version(path, piece=piece, read=digests) == want
    assert content_version(path, piece=piece, read=ReadDigests(piece)) == want  # nothing read: all hashed here


def test_an_update_serves_what_a_fresh_scorer_of_the_new_checkpoint_serves(served, reference_new, checkpoint_dir, second):
    old, new = checkpoint_dir("qwen3_5"), second("qwen3_5")
    backend, reference = served(), reference_new
    work = rows(backend.info.vocab_size, 2)
    before = [backend.score_row(r) for r in work]
    first_version = backend.info.weights_version
    assert all(s.weights_version == first_version for r in before for s in r)

    update = backend.update_weights(new, "step-1")
    assert (update.weights_version, update.previous_version) == ("step-1", first_version)
    assert backend.info.weights_version == "step-1" and update.load_s > 0 and update.swap_ms >= 0
    for i, row in enumerate(work):
        got = backend.score_row(row)
        assert all(s.weights_version == "step-1" for s in got)
        assert_equal(got, reference.score_row(row), f"row {i} after the update")

    back = backend.update_weights(old, None)  # no version: the content hash
    assert back.weights_version == content_version(old) and back.previous_version == "step-1"
    for i, row in enumerate(work):
        assert_equal(backend.score_row(row), before[i], f"row {i} back on the first checkpoint")


def _broken_copies(src: Path, root: Path) -> dict[str, tuple[Path, str]]:
    """Checkpoints that must be refused: name -> (path, CheckpointError kind)."""
    (weights_file,) = src.glob("*.safetensors")
    tensors = load_file(weights_file)
    out = {}

    def variant(name: str, kind: str, tensors_out: dict | None, config: dict | None = None, raw: bytes | None = None):
        d = root / name
        d.mkdir()
        cfg = json.loads((src / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(config or cfg))
        if raw is not None:
            (d / "model.safetensors").write_bytes(raw)
        else:
            save_file(tensors_out, d / "model.safetensors")
        out[name] = (d, kind)

    variant("missing", "incomplete", {k: v for k, v in tensors.items() if k != "model.layers.3.self_attn.q_proj.weight"})
    variant("extra", "incomplete", {**tensors, "model.layers.99.mlp.up_proj.weight": torch.zeros(2, 2)})
    wider = dict(tensors)
    wider["model.norm.weight"] = torch.zeros(wider["model.norm.weight"].shape[0] + 1)
    variant("wrong-shape", "incompatible", wider)
    variant("garbage", "unsupported", None, raw=b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    truncated = weights_file.read_bytes()
    variant("truncated", "unreadable", None, raw=truncated[: len(truncated) // 2])
    # a file still being written: just created, or cut inside its header (retryable, as any file cut short)
    variant("empty", "unreadable", None, raw=b"")
    variant("cut-in-header", "unreadable", None, raw=truncated[:100])
    nan, inf = dict(tensors), dict(tensors)
    nan["model.embed_tokens.weight"] = nan["model.embed_tokens.weight"].clone()
    nan["model.embed_tokens.weight"][5, 3] = float("nan")
    inf["model.layers.3.self_attn.q_proj.weight"] = inf["model.layers.3.self_attn.q_proj.weight"].clone()
    inf["model.layers.3.self_attn.q_proj.weight"][0, 0] = float("-inf")
    variant("nan", "non_finite", nan)
    variant("inf", "non_finite", inf)
    variant("other-model", "unsupported", tensors, config={"model_type": "llama"})
    # The same tensors under a config that computes otherwise: the update would score them with
    # the served settings, so it is refused rather than named after weights it does not serve.
    cfg = json.loads((src / "config.json").read_text())
    for field, value in (("rms_norm_eps", 0.1), ("hidden_act", "gelu")):
        variant(f"config-{field}", "incompatible", tensors, config={**cfg, field: value})
    variant("config-rope", "incompatible", tensors,
            config={**cfg, "rope_parameters": {**cfg["rope_parameters"], "rope_theta": 1234.0}})
    return out


@pytest.mark.parametrize("in_place", [False, True], ids=["beside", "in-place"])
def test_a_failed_update_changes_nothing(served, checkpoint_dir, tmp_path, in_place):
    old = checkpoint_dir("qwen3_5")
    backend = served()
    backend.update_in_place = in_place
    work = rows(backend.info.vocab_size, 2, seed=3)
    before = [backend.score_row(r) for r in work]
    version = backend.info.weights_version
    snapshot = {n: p.clone() for n, p in backend.scorer.loaded.model.named_parameters()}
    for name, (path, kind) in _broken_copies(old, tmp_path).items():
        with pytest.raises(CheckpointError) as caught:
            backend.update_weights(path, "bad")
        assert caught.value.kind == kind, f"{name}: {caught.value.kind} ({caught.value}), want {kind}"
        # named by its whole path, as the start names it: two roots may both hold a 'step-120'
        assert str(path) in str(caught.value), f"{name}: {caught.value} does not name {path}"
        assert backend.info.weights_version == version
        changed = [n for n, p in backend.scorer.loaded.model.named_parameters() if not torch.equal(p, snapshot[n])]
        assert not changed, f"{name}: a failed update changed {changed[:5]}"
    for i, row in enumerate(work):
        got = backend.score_row(row)
        assert all(s.weights_version == version for s in got)
        assert_equal(got, before[i], f"row {i} after the failed updates")
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.self_attn\.q_proj\.weight"):
        backend.update_weights(tmp_path / "missing", None)  # the message names the tensor


def test_an_update_whose_config_differs_only_where_no_number_changes_is_served(served, checkpoint_dir, tmp_path):
    """Names, token ids, storage dtype, initialisation and context length leave every number as it
    was: such a checkpoint is taken; a changed setting of the forward is refused naming it."""
    src = checkpoint_dir("qwen3_5")
    backend = served()
    work = rows(backend.info.vocab_size, 2, seed=4)
    before = [backend.score_row(r) for r in work]
    cfg = json.loads((src / "config.json").read_text())
    neutral = {**cfg, "dtype": "float16", "initializer_range": 0.5, "eos_token_id": 7, "_name_or_path": "elsewhere",
               "max_position_embeddings": cfg["max_position_embeddings"] * 2, "transformers_version": "5.0.0"}
    same = tmp_path / "neutral"
    same.mkdir()
    (same / "config.json").write_text(json.dumps(neutral))
    for f in src.glob("*.safetensors"):
        (same / f.name).write_bytes(f.read_bytes())
    backend.update_weights(same, "neutral")
    for i, row in enumerate(work):
        assert_equal(backend.score_row(row), before[i], f"row {i} after a neutral config change")
    eps = tmp_path / "eps"
    eps.mkdir()
    (eps / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 0.1}))
    for f in src.glob("*.safetensors"):
        (eps / f.name).write_bytes(f.read_bytes())
    with pytest.raises(CheckpointError, match=r"rms_norm_eps 1e-06 -> 0\.1"):
        backend.update_weights(eps, "eps")
    assert backend.info.weights_version == "neutral"


def test_a_config_rewritten_after_the_check_is_unreadable_not_a_server_error(served, second, tmp_path, monkeypatch):
    """config.json being rewritten (no JSON for a moment) after the check passed: the content hash
    reads it again, and the update is refused as retryable, not failed as the server's own bug."""
    import shutil

    import model_runtime.scoring.weights as weights

    path = tmp_path / "step"
    shutil.copytree(second("qwen3_5"), path)
    backend = served()
    old_version, real = backend.info.weights_version, weights.read_parameters

    def read_then_cut_config(*args, **kwargs):
        out = real(*args, **kwargs)
        (path / "config.json").write_text((path / "config.json").read_text()[:50])
        return out

    monkeypatch.setattr(weights, "read_parameters", read_then_cut_config)
    with pytest.raises(CheckpointError) as caught:
        backend.update_weights(path, None)
    assert caught.value.kind == "unreadable" and "config.json" in str(caught.value), caught.value
    assert backend.info.weights_version == old_version


@pytest.mark.parametrize("version", [None, "v-changed"], ids=["content-hash", "named"])
def test_files_that_change_while_read_are_refused_and_change_nothing(served, second, tmp_path, monkeypatch, version):
    """A checkpoint rewritten while it loads (a trainer saving into the directory being read) may
    have given some tensors of each version: refused, nothing swapped, no version named after it."""
    import shutil

    import model_runtime.scoring.weights as weights

    path = tmp_path / "step"
    shutil.copytree(second("qwen3_5"), path)
    backend = served()
    row = rows(backend.info.vocab_size, 1, seed=6)[0]
    before, old_version = backend.score_row(row), backend.info.weights_version
    real = weights.read_parameters

    def read_then_rewrite(*args, **kwargs):
        out = real(*args, **kwargs)
        shard = next(path.glob("*.safetensors"))
        shard.write_bytes(shard.read_bytes())  # the same bytes, written again: a new modification time
        return out

    monkeypatch.setattr(weights, "read_parameters", read_then_rewrite)
    with pytest.raises(CheckpointError, match="changed while they were read") as caught:
        backend.update_weights(path, version)
    assert caught.value.kind == "unreadable" and ".safetensors" in str(caught.value), caught.value  # names the file
    assert str(path) in str(caught.value), caught.value  # and the checkpoint, by its whole path
    assert backend.info.weights_version == old_version
    assert_equal(backend.score_row(row), before, "after the refused update")
    monkeypatch.setattr(weights, "read_parameters", real)
    assert backend.update_weights(path, version).weights_version == (version or content_version(path))


def test_files_the_update_never_reads_may_change_while_it_reads(served, second, tmp_path, monkeypatch):
    """A trainer saving its optimizer state beside the weights (or a tmp file, a safetensors file no index
    names) while the update reads: nothing the update reads changed, so it serves (before, it was refused,
    again and again)."""
    import shutil

    import model_runtime.scoring.weights as weights

    path = tmp_path / "step"
    shutil.copytree(second("qwen3_5"), path)
    backend, real = served(), weights.read_parameters

    def read_while_the_trainer_saves_more(*args, **kwargs):
        out = real(*args, **kwargs)
        for name in ("optimizer.pt", "optimizer.safetensors", "model.safetensors.tmp", "trainer_state.json"):
            (path / name).write_bytes(b"x" * 64)
        return out

    monkeypatch.setattr(weights, "read_parameters", read_while_the_trainer_saves_more)
    assert backend.update_weights(path, "v-optimizer").weights_version == "v-optimizer"


def test_a_forward_during_the_load_finishes_on_the_old_version(served, reference_new, second, monkeypatch):
    import model_runtime.scoring.weights as weights

    new = second("qwen3_5")
    backend = served()
    row = rows(backend.info.vocab_size, 1, seed=5)[0]
    reference_old = backend.score_row(row)
    loaded, release = threading.Event(), threading.Event()
    real = weights.read_parameters

    def slow_read(*args, **kwargs):
        out = real(*args, **kwargs)
        loaded.set()
        assert release.wait(30), "the test never released the load"
        return out

    monkeypatch.setattr(weights, "read_parameters", slow_read)
    result = {}
    updater = threading.Thread(target=lambda: result.setdefault("update", backend.update_weights(new, "v2")))
    updater.start()
    assert loaded.wait(30)
    during = backend.score_row(row)  # the new weights sit beside the old ones, not yet swapped
    assert all(s.weights_version != "v2" for s in during)
    assert_equal(during, reference_old, "forward during the load")
    release.set()
    updater.join(30)
    assert result["update"].weights_version == "v2"
    after = backend.score_row(row)
    assert all(s.weights_version == "v2" for s in after)
    assert_equal(after, reference_new.score_row(row), "forward after the swap")


def test_every_row_under_continuous_load_matches_the_version_it_names(served, reference_new, second):
    new = second("qwen3_5")
    backend = served()
    work = rows(backend.info.vocab_size, 2, seed=7)
    want = {backend.info.weights_version: [backend.score_row(r) for r in work], "new": [reference_new.score_row(r) for r in work]}
    seen, stop = [], threading.Event()

    def load():
        i = 0
        while not stop.is_set():
            got = backend.score_row(work[i % len(work)])
            seen.append((i % len(work), got))
            i += 1

    thread = threading.Thread(target=load)
    thread.start()
    try:
        while len(seen) < 3 and thread.is_alive():
            time.sleep(0.01)
        backend.update_weights(new, "new")
        count = len(seen)
        while len(seen) < count + 3 and thread.is_alive():
            time.sleep(0.01)
    finally:
        stop.set()
        thread.join(30)
    versions = set()
    for i, got in seen:
        (version,) = {s.weights_version for s in got}  # one version per row
        versions.add(version)
        assert_equal(got, want[version][i], f"row {i} named {version}")
    assert versions == set(want), f"saw versions {versions}"


def test_an_update_in_place_serves_the_same_numbers(served, reference_new, second):
    """When a second copy does not fit (forced here), the weights are copied into place between forwards."""
    backend = served()
    backend.update_in_place = True
    before = {id(p): p for p in backend.scorer.loaded.model.parameters()}
    update = backend.update_weights(second("qwen3_5"), "in-place")
    assert update.weights_version == "in-place"
    assert {id(p) for p in backend.scorer.loaded.model.parameters()} == set(before)
    row = rows(backend.info.vocab_size, 1, seed=9)[0]
    assert_equal(backend.score_row(row), reference_new.score_row(row), "after an update in place")


def test_checking_a_checkpoint_leaves_the_process_default_dtype_alone(kind, checkpoint_dir, monkeypatch, tmp_path):
    """An update checks its checkpoint (a model built on the meta device) while another thread
    serves: torch's default dtype is process-wide, and a bf16 default there would reach that
    thread's new tensors and the guards of its compiled functions."""
    from model_runtime.scoring.checkpoint_config import _tensors_of_config
    from tests.checkpoints import rewrite_checkpoint

    path = rewrite_checkpoint(checkpoint_dir(kind), tmp_path / "bf16", edit_config=lambda c: {**c, "dtype": "bfloat16"})
    served = load_model(str(checkpoint_dir(kind)), device="cpu")
    _tensors_of_config.cache_clear()  # built here, not taken from an earlier check
    calls = []
    monkeypatch.setattr(torch, "set_default_dtype", lambda d: calls.append(d))
    plan_reads(served.model, path)
    assert not calls, f"checking a checkpoint set the default dtype: {calls}"


def test_with_an_index_a_stale_file_beside_its_shards_is_never_read(second, checkpoint_dir, tmp_path):
    """A sharded save into a directory that still holds an older single-file save: Hugging Face
    reads the index's shards only, and so must an update and the shard-by-shard reader."""
    import shutil

    from model_runtime.scoring.weights import materialize

    path = tmp_path / "resaved"
    save_checkpoint("qwen3_5", path, seed=1, max_shard_size="200KB")
    assert (path / "model.safetensors.index.json").is_file()
    shutil.copy(next(checkpoint_dir("qwen3_5").glob("*.safetensors")), path / "model.safetensors")  # the older save
    want = dict(load_model(str(second("qwen3_5")), device="cpu").model.named_parameters())
    served = load_model(str(checkpoint_dir("qwen3_5")), device="cpu")
    new = read_parameters(served.model, plan_reads(served.model, path))
    later = load_model(str(path), device="cpu", weights_later=True)
    materialize(later.model, path, torch.device("cpu"))
    for how, got in (("update", new), ("shard by shard", dict(later.model.named_parameters()))):
        differ = [n for n, t in got.items() if not torch.equal(t, want[n])]
        assert not differ, f"{how}: {len(differ)} parameters read from the stale file: {differ[:3]}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_the_host_finiteness_check_by_bits_equals_torch_isfinite(dtype):
    """``non_finite`` checks host tensors by their exponent bits; every special value and chunk
    edge must be judged as ``torch.isfinite`` judges it."""
    from model_runtime.scoring.weights import non_finite

    info = torch.finfo(dtype)
    specials = [float("nan"), float("inf"), -float("inf"), info.max, -info.max, info.tiny, info.tiny / 4, -0.0]
    rng = np.random.default_rng(0)
    for special in specials:
        for at in (0, 999, 1000, 1001, 4095):
            t = torch.from_numpy(rng.standard_normal(4096)).to(dtype)
            t[at] = special
            want = [] if bool(torch.isfinite(t).all()) else ["t"]
            got = non_finite([("t", t)], chunk=1000)
            assert got == want, f"{dtype}, {special} at {at}: got {got}, torch.isfinite says {want}"


def test_an_update_in_place_checks_for_nan_while_the_old_weights_still_serve(served, second, monkeypatch):
    """The NaN pass of an update in place reads the whole checkpoint: forwards must not wait for
    it, only for the copy into place."""
    from model_runtime.scoring import weights

    backend = served()
    backend.update_in_place = True
    held = []
    real = weights.refuse_non_finite_reads
    monkeypatch.setattr(weights, "refuse_non_finite_reads",
                        lambda *a, **k: held.append(backend._lock.locked()) or real(*a, **k))
    backend.update_weights(second("qwen3_5"), "in-place")
    assert held == [False], f"the NaN pass ran {len(held)} times, under the forward lock: {held}"


def test_an_update_in_place_says_so_while_it_copies_and_only_then(served, second, monkeypatch):
    from model_runtime.scoring import weights

    backend = served()
    backend.update_in_place = True
    seen = []
    for name in ("refuse_non_finite_reads", "read_parameters"):
        real = getattr(weights, name)
        monkeypatch.setattr(weights, name, lambda *a, _real=real, _name=name, **k:
                            seen.append((_name, backend.copying_in_place)) or _real(*a, **k))
    backend.update_weights(second("qwen3_5"), "in-place")
    assert seen == [("refuse_non_finite_reads", False), ("read_parameters", True)], seen
    assert not backend.copying_in_place


@pytest.mark.parametrize("when", ["after the NaN pass", "during the copy", "during the copy, nothing to copy back"])
def test_files_that_change_during_an_update_in_place_are_never_served_under_a_version(served, second, tmp_path,
                                                                                     monkeypatch, when):
    """In place there is no second copy to fall back on: files changed after the NaN pass are
    refused before anything is copied; changed during the copy, the served version is copied back
    from its own checkpoint, and where it cannot be, the weights served are named as a mix that no
    pinned request (nor a later version given) matches."""
    import shutil

    import model_runtime.scoring.weights as weights

    path = tmp_path / "step"
    shutil.copytree(second("qwen3_5"), path)
    backend = served()
    backend.update_in_place = True
    row = rows(backend.info.vocab_size, 1, seed=6)[0]
    before, old_version = backend.score_row(row), backend.info.weights_version
    hooked = weights.refuse_non_finite_reads if when == "after the NaN pass" else weights.read_parameters
    if when.endswith("nothing to copy back"):
        backend._served_from = None  # as for a preset's weights

    def then_rewrite(*args, **kwargs):
        out = hooked(*args, **kwargs)
        shard = next(path.glob("*.safetensors"))
        shard.write_bytes(shard.read_bytes())  # the same bytes, written again: a new modification time
        return out

    monkeypatch.setattr(weights, hooked.__name__, then_rewrite)
    with pytest.raises(CheckpointError) as caught:
        backend.update_weights(path, None)
    assert caught.value.kind == "unreadable", caught.value
    if when == "after the NaN pass":
        assert backend.info.weights_version == old_version
        assert_equal(backend.score_row(row), before, "after the refused update")
    elif when == "during the copy":  # a failed update changes nothing (API.md)
        assert backend.info.weights_version == old_version and "copied back" in str(caught.value), caught.value
        assert_equal(backend.score_row(row), before, "after the update copied back")
    else:
        served_now = backend.info.weights_version
        assert served_now.startswith(weights.MIXED_VERSION_PREFIX) and served_now in str(caught.value), caught.value
        assert all(s.weights_version == served_now for s in backend.score_row(row))


def fail_once_copied(monkeypatch, failure: Exception) -> list:
    """``read_parameters`` copies the new weights in place, then raises ``failure`` once (a disk
    gone, a CUDA fault); later reads, the copy back, work. Returns the list of calls made."""
    import model_runtime.scoring.weights as weights

    real, calls = weights.read_parameters, []

    def hooked(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(args[1])
        if len(calls) == 1:
            raise failure
        return out

    monkeypatch.setattr(weights, "read_parameters", hooked)
    return calls


def test_an_update_in_place_whose_copy_fails_copies_the_served_weights_back(served, second, monkeypatch):
    backend = served()
    backend.update_in_place = True
    row = rows(backend.info.vocab_size, 1, seed=7)[0]
    before, old_version = backend.score_row(row), backend.info.weights_version
    calls = fail_once_copied(monkeypatch, OSError("input/output error"))
    with pytest.raises(CheckpointError) as caught:
        backend.update_weights(second("qwen3_5"), "step-2")
    assert len(calls) == 2 and "input/output error" in str(caught.value) and "copied back" in str(caught.value)
    assert backend.info.weights_version == old_version and not backend.copying_in_place
    assert_equal(backend.score_row(row), before, "after the failed update in place")


def test_a_server_fault_during_an_update_in_place_is_raised_as_it_is_once_the_weights_are_back(served, second,
                                                                                              monkeypatch):
    backend = served()
    backend.update_in_place = True
    row = rows(backend.info.vocab_size, 1, seed=8)[0]
    before, old_version = backend.score_row(row), backend.info.weights_version
    fail_once_copied(monkeypatch, RuntimeError("CUDA error: an illegal memory access was encountered"))
    with pytest.raises(RuntimeError, match="illegal memory access") as caught:
        backend.update_weights(second("qwen3_5"), "step-3")
    assert not isinstance(caught.value, CheckpointError)  # not the checkpoint's fault: no 422
    assert backend.info.weights_version == old_version
    assert_equal(backend.score_row(row), before, "after the fault, the served weights copied back")


def test_the_served_checkpoint_is_remembered_as_its_files_were_when_read(checkpoint_dir):
    from model_runtime.scoring.weights import files_snapshot

    path = checkpoint_dir("qwen3_5")
    loaded = load_model(str(path), device="cpu")
    assert loaded.source_files == files_snapshot(path)
    assert load_model("tiny", device="cpu").source_files is None  # a preset: nothing to copy back from
