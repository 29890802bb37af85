"""The expert-GEMM library's Python side on the CPU: the tile-aligned layout, the plain reference
product, how a missing or wrong library is reported, and the build command's errors. The kernel
itself against torch._grouped_mm, bit for bit: tests/gpu/test_moe_fused.py."""

import subprocess
import sys

import pytest
import torch

from model_runtime.kernels import expert_gemm


@pytest.fixture
def fresh_library(monkeypatch):
    """``_load`` caches one load per file and process: clear it around a test that points elsewhere."""
    expert_gemm._load.cache_clear()
    yield monkeypatch
    expert_gemm._load.cache_clear()


@pytest.mark.parametrize("counts", [[5, 0, 300, 128, 1], [0, 0, 0, 7], [128] * 6, [0] * 3 + [1000]],
                         ids=lambda c: "-".join(map(str, c[:5])))
@pytest.mark.parametrize("tile", [64, 128])
def test_layout_starts_every_expert_on_a_tile_and_names_each_tiles_expert(counts, tile):
    counts_E = torch.tensor(counts)
    rows = expert_gemm.layout_rows(int(counts_E.sum()), len(counts), tile)
    starts, tile_expert = expert_gemm.expert_layout(counts_E, tile, rows)
    assert rows % tile == 0 and tile_expert.dtype == torch.int32 and tile_expert.shape == (rows // tile,)
    assert bool((starts % tile == 0).all())
    end = 0
    for e, n in enumerate(counts):
        assert int(starts[e]) == end, f"expert {e} starts at {int(starts[e])}, want {end}"
        first, tiles = end // tile, -(-n // tile)
        assert tile_expert[first:first + tiles].tolist() == [e] * tiles
        end += tiles * tile
    assert end <= rows, f"the layout needs {end} rows, layout_rows gave {rows}"
    assert bool((tile_expert[end // tile:] == -1).all())


def test_layout_rows_hold_the_worst_case():
    for pairs, experts, tile in ((1, 256, 128), (524160, 256, 128), (7, 3, 64)):
        worst = [1] * (experts - 1) + [pairs - experts + 1] if pairs >= experts else [1] * pairs
        need = sum(-(-n // tile) * tile for n in worst)
        assert expert_gemm.layout_rows(pairs, experts, tile) >= need


def test_reference_product_equals_per_expert_products():
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 9, 1])
    tile = 4
    rows = expert_gemm.layout_rows(int(counts.sum()), 4, tile)
    starts, tile_expert = expert_gemm.expert_layout(counts, tile, rows)
    x = torch.randn(rows, 6, generator=g)
    w = torch.randn(4, 5, 6, generator=g)
    got = expert_gemm.reference_product(tile).mm(x, w, tile_expert)
    for e, n in enumerate(counts.tolist()):
        s = int(starts[e])
        want = x[s:s + n] @ w[e].T
        diff = float((got[s:s + n] - want).abs().max()) if n else 0.0
        assert diff <= 1e-6, f"expert {e}: max |diff| {diff:.3e} (tolerance 1e-6: a CPU BLAS rounds by row count)"
    tail = int(starts[-1]) + -(-int(counts[-1]) // tile) * tile
    assert bool((got[tail:] == 0).all())


def test_reference_silu_product_is_silu_gate_times_up():
    """``expert_mm_silu``'s reference: the product, then ``F.silu(gate) * up``, gate rows first."""
    g = torch.Generator().manual_seed(1)
    counts = torch.tensor([5, 2, 0])
    tile, I = 4, 3
    rows = expert_gemm.layout_rows(int(counts.sum()), 3, tile)
    starts, tile_expert = expert_gemm.expert_layout(counts, tile, rows)
    x, w = torch.randn(rows, 6, generator=g), torch.randn(3, 2 * I, 6, generator=g)
    product = expert_gemm.reference_product(tile, silu=True)
    got = product.mm_silu(x, w, tile_expert)
    assert got.shape == (rows, I) and expert_gemm.reference_product(tile).mm_silu is None
    for e, n in enumerate(counts.tolist()):
        s = int(starts[e])
        y = x[s:s + n] @ w[e].T
        want = torch.nn.functional.silu(y[:, :I]) * y[:, I:]
        diff = float((got[s:s + n] - want).abs().max()) if n else 0.0
        assert diff <= 1e-6, f"expert {e}: max |diff| {diff:.3e} (tolerance 1e-6)"


def test_the_silu_product_refuses_an_intermediate_size_off_its_pairs():
    with pytest.raises(ValueError, match="2I a multiple of 128"):
        expert_gemm.expert_mm_silu(torch.zeros(128, 8, dtype=torch.bfloat16), torch.zeros(2, 96, 8, dtype=torch.bfloat16),
                                   torch.zeros(1, dtype=torch.int32))


def test_the_silu_kernels_layout_facts_hold_where_a_library_is_built():
    """The library checks on the host, with CUTLASS's own layouts, that every thread's accumulator
    for up column j sits beside gate column j and that each tile reads the gate and up rows it
    should (``check_silu_layout``); runs where a library is built (the GPU runs carry one)."""
    if expert_gemm._library()[0] is None:
        pytest.skip(f"no expert GEMM library here: {expert_gemm._library()[1]}")
    assert expert_gemm.silu_layout_check() == 0


def test_the_library_declares_the_abi_this_module_wants():
    assert f"kAbiVersion = {expert_gemm.ABI_VERSION};" in expert_gemm.SOURCE.read_text()


def test_a_missing_library_is_reported_with_its_path_and_the_build_command(fresh_library, tmp_path):
    fresh_library.setenv("PACKSCORE_EXPERT_GEMM", str(tmp_path / "absent.so"))
    lib, reason = expert_gemm._library()
    assert lib is None and "absent.so" in reason and "python -m model_runtime.kernels.expert_gemm" in reason
    with pytest.raises(RuntimeError, match="absent.so"):
        expert_gemm.cutlass_product()


def test_a_file_that_is_no_library_is_refused(fresh_library, tmp_path):
    bad = tmp_path / "bad.so"
    bad.write_bytes(b"not an ELF file")
    fresh_library.setenv("PACKSCORE_EXPERT_GEMM", str(bad))
    lib, reason = expert_gemm._library()
    assert lib is None and "bad.so" in reason


def test_the_default_library_path_follows_the_cache_dir_and_the_source(fresh_library, tmp_path):
    fresh_library.delenv("PACKSCORE_EXPERT_GEMM", raising=False)
    fresh_library.setenv("PACKSCORE_CACHE_DIR", str(tmp_path))
    path = expert_gemm.library_path()
    assert path.parent == tmp_path / "kernels" and expert_gemm.source_hash() in path.name


def test_resolving_the_default_library_hashes_the_source_once(monkeypatch):
    """An experts' call without a bound library (``kernel_backend``'s swap, a direct call) resolves
    ``library_path()`` several times per MoE layer and forward: the source is not read and hashed each time."""
    from pathlib import Path

    monkeypatch.delenv("PACKSCORE_EXPERT_GEMM", raising=False)
    getattr(expert_gemm.source_hash, "cache_clear", lambda: None)()
    reads = []
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: reads.append(self) or real(self))
    paths = {expert_gemm.library_path() for _ in range(5)}
    assert len(paths) == 1 and reads.count(expert_gemm.SOURCE) == 1, f"the source was read {reads.count(expert_gemm.SOURCE)} times"


def test_a_named_library_wins_over_the_environment(fresh_library, tmp_path):
    fresh_library.setenv("PACKSCORE_EXPERT_GEMM", str(tmp_path / "from-env.so"))
    assert expert_gemm.library_path() == tmp_path / "from-env.so"
    assert expert_gemm.library_path(tmp_path / "named.so") == tmp_path / "named.so"
    lib, reason = expert_gemm._library(tmp_path / "named.so")
    assert lib is None and "named.so" in reason


def test_the_backend_choice_probes_and_binds_the_named_library(monkeypatch, tmp_path):
    """``select_backends(expert_gemm=...)`` checks that file (``--expert-gemm``) and binds it into
    the experts' function, with no environment variable set."""
    from model_runtime.kernels import registry

    monkeypatch.delenv("PACKSCORE_EXPERT_GEMM", raising=False)
    lib = tmp_path / "named.so"
    probed = []
    monkeypatch.setattr(expert_gemm, "unavailable_reason", lambda library=None: probed.append(library))
    monkeypatch.setattr(expert_gemm, "silu_layout_check", lambda library=None: probed.append(library) or 0)
    registry._unavailable_reason("moe_experts", "expert_tiles_silu", lib)  # then Triton's import, where it is installed
    assert probed == [lib, lib]

    asked = []
    monkeypatch.setattr(registry, "_unavailable_reason",
                        lambda family, name, library=None: asked.append(library) if family == "moe_experts" else None)
    backends = registry.select_backends("cuda", expert_gemm=str(lib))
    assert backends.moe_experts == "expert_tiles_silu" and backends.expert_gemm == lib and set(asked) == {lib}
    fn = backends.fn("moe_experts")
    assert fn.func is registry.REGISTRY["moe_experts"]["expert_tiles_silu"] and fn.keywords == {"library": lib}
    other = registry.select_backends("cuda", overrides={"moe_experts": "grouped_mm"}, expert_gemm=lib)
    assert other.expert_gemm is None and other.fn("moe_experts") is registry.REGISTRY["moe_experts"]["grouped_mm"]


def test_expert_gemm_reaches_a_pool_workers_backend_choice(monkeypatch, tmp_path):
    """``--expert-gemm`` travels from the settings through the pool's Start message to the
    worker's ``load_model`` and its ``select_backends``, with no environment variable set; so
    does ``--kernels``, as the mapping the settings parsed."""
    from model_runtime.pool import messages as msg
    from model_runtime.pool import pool, worker
    from model_runtime.scoring import loading
    from service.settings import Settings

    monkeypatch.delenv("PACKSCORE_EXPERT_GEMM", raising=False)
    lib = tmp_path / "named.so"
    fields = {}

    def no_world(self):
        fields.update(self._start_fields)
        raise RuntimeError("no workers in this test")

    monkeypatch.setattr(pool.WorkerPool, "_start_world", no_world)
    with pytest.raises(RuntimeError, match="no workers"):
        pool.start_pool(Settings(expert_gemm=lib, kernels="moe_router=topk", world_size=2, device="cpu").model_dump())
    start = msg.decode(msg.encode(msg.Start(rank=0, generation=0, master_port=0, **fields)))
    chosen = []
    real = loading.select_backends
    monkeypatch.setattr(loading, "select_backends",
                        lambda *a, **k: chosen.append((k["expert_gemm"], k["overrides"])) or real(*a, **k))
    worker._load(start, torch.device("cpu"))
    assert chosen == [(str(lib), {"moe_router": "topk"})]


def test_expert_gemm_reaches_the_scorers_backend_choice(monkeypatch, tmp_path):
    """In one process ``--expert-gemm`` goes from the settings to ``load_model``'s ``select_backends``."""
    from model_runtime.scoring import loading
    from service.backends import load_backend
    from service.settings import Settings

    monkeypatch.delenv("PACKSCORE_EXPERT_GEMM", raising=False)
    chosen = []
    real = loading.select_backends
    monkeypatch.setattr(loading, "select_backends", lambda *a, **k: chosen.append(k["expert_gemm"]) or real(*a, **k))
    load_backend(Settings(expert_gemm=tmp_path / "named.so", device="cpu")).close()
    assert chosen == [tmp_path / "named.so"]


def test_without_cuda_the_backend_is_unavailable_and_the_cpu_refuses_it():
    from model_runtime.kernels.registry import select_backends

    if not torch.cuda.is_available():
        assert expert_gemm.unavailable_reason() == "no CUDA device"
        for name in ("expert_tiles", "expert_tiles_silu"):
            with pytest.raises(ValueError, match="needs CUDA"):
                select_backends("cpu", overrides={"moe_experts": name})


def test_build_names_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="nvcc"):
        expert_gemm.build(tmp_path, tmp_path / "lib.so", nvcc=str(tmp_path / "no-nvcc"))
    fake_nvcc = tmp_path / "nvcc"
    fake_nvcc.write_text("#!/bin/sh\nexit 1\n")
    with pytest.raises(FileNotFoundError, match="CUTLASS"):
        expert_gemm.build(tmp_path, tmp_path / "lib.so", nvcc=str(fake_nvcc))


def test_the_build_command_documents_itself():
    out = subprocess.run([sys.executable, "-m", "model_runtime.kernels.expert_gemm", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "--cutlass" in out and "--out" in out and expert_gemm.CUTLASS_VERSION in out
