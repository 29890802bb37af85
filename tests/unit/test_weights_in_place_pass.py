"""The pass before an update in place: one read of the checkpoint checks its values and takes its content hash."""

import copy
import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from safetensors.torch import save_file

from model_runtime.scoring import content_hash, weights
from model_runtime.scoring.backend import LocalBackend
from model_runtime.scoring.checkpoint_error import CheckpointError
from model_runtime.scoring.loading import load_model
from model_runtime.scoring.scorer import Scorer
from model_runtime.scoring.content_hash import content_version
from model_runtime.scoring.weights import plan_reads, refuse_non_finite_reads
from tests.checkpoints import rewrite_checkpoint, save_checkpoint

UNREAD = {"mtp.fc.weight": torch.ones(3, 5), "mtp.layers.0.mlp.up_proj.weight": torch.full((4, 2), float("nan"))}


def with_unread_shard(path: Path) -> Path:
    """``path`` (a sharded save) with one more shard holding tensors the model never reads (``mtp.*``, one NaN)."""
    save_file(UNREAD, path / "model-mtp.safetensors", metadata={"format": "pt"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(UNREAD, "model-mtp.safetensors"))
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """layout -> a seed-1 qwen3_5 checkpoint: one file, or shards and a shard of unread tensors."""
    root = tmp_path_factory.mktemp("in-place-pass")
    one = save_checkpoint("qwen3_5", root / "one", seed=1)
    sharded = with_unread_shard(save_checkpoint("qwen3_5", root / "sharded", seed=1, max_shard_size="200KB"))
    assert len(list(sharded.glob("*.safetensors"))) > 2
    return {"one file": one, "shards and unread tensors": sharded}


@pytest.fixture(scope="module")
def served(checkpoint_dir):
    loaded = load_model(str(checkpoint_dir("qwen3_5")), device="cpu")

    def make() -> LocalBackend:
        backend = LocalBackend(Scorer(copy.deepcopy(loaded)))
        backend.update_in_place = True
        return backend

    return make


def reference_version(path: Path, piece: int) -> str:
    """The content version as specified, read plainly: config settings, then per tensor in name
    order ``name|dtype|shape|<xxh3-128 of each piece of its bytes>``."""
    files = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values() \
        if (path / "model.safetensors.index.json").is_file() else ["model.safetensors"]
    lines = {}
    for file in sorted(set(files)):
        raw = (path / file).read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        for name, info in header.items():
            if name != "__metadata__":
                begin, end = info["data_offsets"]
                data = raw[8 + n + begin:8 + n + end]
                digests = [xxhash.xxh3_128(data[i:i + piece]).hexdigest() for i in range(0, max(1, len(data)), piece)]
                lines[name] = f"{name}|{info['dtype']}|{info['shape']}|{','.join(digests)}\n"
    total = xxhash.xxh3_128(json.dumps(json.loads((path / "config.json").read_text()), sort_keys=True,
                                       separators=(",", ":")).encode())
    for name in sorted(lines):
        total.update(lines[name].encode())
    return f"xxh3-{total.hexdigest()[:12]}"


def test_the_content_version_keeps_its_value(tmp_path):
    """Replicas and clients compare versions: the value of a fixed checkpoint may never change
    (the values below are pinned: versions already served carry them)."""
    t = {"a.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b.weight": torch.arange(10).to(torch.bfloat16),
         "c.empty": torch.zeros(0, 4)}
    save_file(t, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "golden", "hidden_size": 4}))
    got = (content_version(tmp_path), content_version(tmp_path, piece=8))
    assert got == ("xxh3-ccff8469b8ea", "xxh3-408abf95a32c"), got
    assert reference_version(tmp_path, 8) == got[1]


@pytest.mark.parametrize("layout", ["one file", "shards and unread tensors"])
@pytest.mark.parametrize("piece", [None, 1000])
def test_the_in_place_pass_hashes_what_content_version_does(checkpoints, checkpoint_dir, layout, piece):
    """The version the pass takes from the bytes it checks is ``content_version(path)`` exactly,
    the tensors the model does not read included, in any piece size."""
    path = checkpoints[layout]
    model = load_model(str(checkpoint_dir("qwen3_5")), device="cpu").model
    plan = plan_reads(model, path)
    piece = piece or content_hash.CONTENT_PIECE
    version, bad = content_hash.scan_tensors(path, finite={n for r in plan.reads for n in r.parts}, piece=piece)
    assert not bad, bad  # the NaN of an unread tensor is not the model's
    assert version == content_version(path, piece=piece) == reference_version(path, piece)
    assert refuse_non_finite_reads(model, plan, content=True) == content_version(path)
    assert refuse_non_finite_reads(model, plan) is None


@pytest.mark.parametrize("version", [None, "step-9"], ids=["content-hash", "named"])
def test_an_update_in_place_reads_the_checkpoint_once_before_the_copy(served, checkpoints, monkeypatch, version):
    """One pass checks (and, without a version, hashes) every tensor; then the copy. No hash
    pass of its own: its version is still ``content_version``'s."""
    path = checkpoints["shards and unread tensors"]
    want_version = version or content_version(path)
    real_read_at, real_mapped = content_hash._read_at, weights._MappedFile.read
    read = {"positioned": 0, "mapped": 0}
    counting = threading.Lock()  # the reads run on a thread pool: a bare += there can lose a count

    def read_at(fd, view, offset):
        n = real_read_at(fd, view, offset)
        with counting:
            read["positioned"] += n
        return n

    def mapped(self, name, rows=None):
        out = real_mapped(self, name, rows)
        with counting:
            read["mapped"] += out.numel() * out.element_size()
        return out

    monkeypatch.setattr(content_hash, "_read_at", read_at)
    monkeypatch.setattr(weights._MappedFile, "read", mapped)
    monkeypatch.setattr(content_hash, "content_version", lambda *a, **k: pytest.fail("a hash pass of its own"))
    backend = served()
    plan = plan_reads(backend.scorer.loaded.model, path)
    sizes = {}
    for file in path.glob("*.safetensors"):
        with weights.TensorFile(file) as f:
            sizes.update({name: f.locate(name)[3] for name in f.keys()})
    model_bytes = sum(sizes[n] for r in plan.reads for n in r.parts)
    update = backend.update_weights(path, version)
    assert update.weights_version == want_version
    want = sum(sizes.values()) if version is None else model_bytes
    assert read == {"positioned": want, "mapped": model_bytes}, (read, want, model_bytes)


@pytest.mark.parametrize("version", [None, "step-9"], ids=["content-hash", "named"])
def test_an_update_in_place_refuses_nan_naming_the_tensor_before_anything_is_copied(served, tmp_path, monkeypatch,
                                                                                   checkpoint_dir, version):
    backend = served()
    old = checkpoint_dir("qwen3_5")
    before = {n: p.clone() for n, p in backend.scorer.loaded.model.named_parameters()}
    served_version = backend.info.weights_version

    def poison(t):
        bad = t["model.layers.2.mlp.down_proj.weight"].clone()
        bad[1, -1] = float("nan")
        return {**t, "model.layers.2.mlp.down_proj.weight": bad}

    path = rewrite_checkpoint(old, tmp_path / "nan", poison)
    monkeypatch.setattr(weights, "read_parameters", lambda *a, **k: pytest.fail("copied before the check"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.down_proj\.weight") as caught:
        backend.update_weights(path, version)
    assert caught.value.kind == "non_finite", caught.value
    assert backend.info.weights_version == served_version
    changed = [n for n, p in backend.scorer.loaded.model.named_parameters() if not torch.equal(p, before[n])]
    assert not changed, changed


def test_expert_tensors_holding_nan_are_named_as_the_files_name_them(checkpoint_dir, tmp_path):
    model = load_model(str(checkpoint_dir("qwen3_5_moe")), device="cpu").model
    name = "model.layers.1.mlp.experts.3.down_proj.weight"

    def poison(t):
        return {**t, name: torch.where(torch.arange(t[name].numel()).reshape(t[name].shape) == 7, float("inf"), t[name])}

    path = rewrite_checkpoint(checkpoint_dir("qwen3_5_moe"), tmp_path / "inf", poison)
    with pytest.raises(CheckpointError, match=rf"1 weight tensor holds .*\({name}\)") as caught:
        refuse_non_finite_reads(model, plan_reads(model, path), content=True)
    assert caught.value.kind == "non_finite"


def test_a_checked_tensor_cut_short_is_refused(tmp_path):
    save_file({"w": torch.ones(1000), "z": torch.zeros(1000)}, tmp_path / "model.safetensors")
    raw = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(raw[:-100])  # the file cut while read: "z" short
    with pytest.raises(content_hash.TensorFileError, match="short of tensor z"):
        content_hash.scan_tensors(tmp_path, finite={"w", "z"})
    assert content_hash.scan_tensors(tmp_path, finite={"w"}) == (content_version(tmp_path), [])


@pytest.mark.parametrize("dtype", sorted(content_hash.FLOAT_BITS, key=str))
def test_the_check_by_bits_across_its_chunks_equals_torch_isfinite(dtype, monkeypatch):
    monkeypatch.setattr(content_hash, "BITS_CHUNK", 64)  # values that straddle the chunks' edges
    rng = np.random.default_rng(1)
    for special in (float("nan"), float("inf"), -float("inf"), torch.finfo(dtype).max, None):
        for at in (0, 63 // dtype.itemsize, 64 // dtype.itemsize, 999):
            t = torch.from_numpy(rng.standard_normal(1000)).to(dtype)
            if special is not None:
                t[at] = special
            want = bool(torch.isfinite(t.double()).all())  # widened: the CPU has no isfinite for float8
            got = content_hash.finite_bits(t.view(torch.uint8).numpy(), dtype)
            assert got == want, f"{dtype}, {special} at {at}: by bits {got}, torch.isfinite {want}"
