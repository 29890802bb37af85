"""TensorFile (model_runtime/scoring/tensor_file.py): the tensors safetensors itself reads, by
positioned reads; a file cut short while open is an error, not a fault that kills the process."""

import os

import numpy as np
import pytest
import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import save_file

from model_runtime.scoring.tensor_file import PieceDigest, TensorFile, TensorFileError
from tests.checkpoints import HostStaging


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "bf16": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "f32": torch.randn(3, 4, 2, generator=g),
        "i64": torch.arange(-5, 6),
        "bool": torch.rand(9, generator=g) > 0.5,
        "f8": torch.randn(4, 8, generator=g).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
    }


def test_reads_what_safetensors_reads_whole_and_by_rows(tmp_path):
    file = tmp_path / "t.safetensors"
    save_file(_tensors(), str(file))
    with TensorFile(file) as f, safe_open(file, framework="pt") as want:
        assert sorted(f.keys()) == sorted(want.keys())
        for name in want.keys():
            expected = want.get_tensor(name)
            got = f.read(name)
            assert got.dtype == expected.dtype and got.shape == expected.shape, name
            assert torch.equal(got.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)), name
            assert f.shape(name) == tuple(expected.shape)
        assert torch.equal(f.read("bf16", slice(2, 5)), want.get_slice("bf16")[2:5])
        assert torch.equal(f.read("f32", slice(1, 3)), want.get_tensor("f32")[1:3])
        assert f.read("bf16", slice(4, 4)).shape == (0, 5)


@pytest.mark.parametrize("slot_bytes", [7, 64, 1 << 20])
def test_reading_through_staging_slots_gives_the_same_bytes(tmp_path, slot_bytes):
    """``read_into`` with staging (a GPU's path, here host buffers) cuts a tensor into slot-sized
    pieces; every piece lands where a whole read puts it, the last one shorter included."""
    file = tmp_path / "t.safetensors"
    save_file(_tensors(), str(file))
    staging = HostStaging(3, slot_bytes)
    with TensorFile(file) as f:
        for name, rows in [*((n, None) for n in f.keys()), ("bf16", slice(2, 5)), ("f32", slice(1, 3)), ("bf16", slice(4, 4))]:
            want = f.read(name, rows).reshape(-1).view(torch.uint8)
            for through in (staging, None):
                got = torch.full((want.numel(),), 0xAB, dtype=torch.uint8)
                f.read_into(got, name, rows, through)
                assert torch.equal(got, want), f"{name} rows {rows} (slots of {slot_bytes} bytes: {through is not None})"
        with pytest.raises(ValueError, match="bytes"):
            f.read_into(torch.empty(3, dtype=torch.uint8), "f32")


def test_a_file_cut_short_while_open_is_an_error(tmp_path):
    file = tmp_path / "t.safetensors"
    save_file({"w": torch.randn(256, 256)}, str(file))
    with TensorFile(file) as f:
        os.truncate(file, file.stat().st_size // 2)  # a re-save begins with a truncation
        with pytest.raises(TensorFileError, match="short"):
            f.read("w")
        with pytest.raises(TensorFileError, match="short"):
            f.read_into(torch.empty(256 * 256 * 4, dtype=torch.uint8), "w", staging=HostStaging(2, 4096))


@pytest.mark.parametrize("cut", [4, 20, -100])
def test_a_damaged_file_is_refused_at_open(tmp_path, cut):
    file = tmp_path / "t.safetensors"
    save_file({"w": torch.randn(64, 64)}, str(file))
    os.truncate(file, cut if cut > 0 else file.stat().st_size + cut)
    with pytest.raises(TensorFileError):
        TensorFile(file)


@pytest.mark.parametrize("size", [0, 1, 99, 100, 101, 300, 1234])
def test_a_piece_digest_fed_in_any_cuts_hashes_each_piece(size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    want = [xxhash.xxh3_128(data[i:i + 100]).hexdigest() for i in range(0, max(size, 1), 100)]
    rng = np.random.default_rng(0)
    for _ in range(5):
        digest, at = PieceDigest(100), 0
        while at < size:
            n = int(rng.integers(1, 250))
            digest.update(memoryview(data[at:at + n]))
            at += n
        assert digest.hexdigests() == want, f"{size} bytes"
