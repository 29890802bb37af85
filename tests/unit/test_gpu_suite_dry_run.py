"""bench/gpu_suite.py's CPU dry run: every phase that needs no GPU runs with the tiny presets, so
the suite's code paths are checked here before a device call spends GPU time on them."""

import json

from bench import gpu_suite, suite_harness


def test_dry_run_measures_every_side(tmp_path):
    gpu_suite.main(["--dry-run-cpu", "--out", str(tmp_path)])
    assert suite_harness.DEVICE == "cuda", "the dry run left the suite on the CPU"
    (path,) = tmp_path.glob("h200-*.json")
    results = json.loads(path.read_text())
    for phase in ("benchmark tiny", "experts grouped_mm vs eager (tiny)", "GPU tests (all skip on CPU)"):
        assert results["phases"][phase].startswith("ok"), (phase, results["phases"], results["errors"])
    bench = results["tiny"]
    assert set(bench["sides"]) == {"packscore", "packscore_rows_read_back_one_by_one", "hf_padded", "hf_single",
                                   "packscore_attention_sdpa", "packscore_gate_projection_row"}
    assert bench["diff_packscore_rows_read_back_one_by_one_vs_packscore"]["logprob_max"] == 0
    assert bench["speedup_vs_hf"] > 0 and bench["diff_packscore_vs_hf_single"]["logprob_max"] < 1e-3
    assert isinstance(bench["compiled_during_first_pass"], dict)


def test_compiled_between_names_the_new_cache_entries(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert suite_harness.compiled_kernels() == {}
    for entry, name in (("a1", "rms_norm_kernel"), ("b2", "conv_silu_kernel")):
        (tmp_path / entry).mkdir()
        (tmp_path / entry / f"{name}.cubin").write_bytes(b"")
    before = suite_harness.compiled_kernels()
    for entry in ("c3", "d4"):
        (tmp_path / entry).mkdir()
        (tmp_path / entry / "conv_silu_kernel.cubin").write_bytes(b"")
    (tmp_path / "e5").mkdir()  # a compilation still being written: no cubin yet
    assert suite_harness.compiled_between(before, suite_harness.compiled_kernels()) == {"conv_silu_kernel": 2}


def test_gpu_clocks_summarise_nvidia_smi_samples_and_nothing_without_it(monkeypatch, tmp_path):
    from bench.gpu_probes import GpuClocks

    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi here: an empty summary, no error
    with GpuClocks() as clocks:
        pass
    assert clocks.summary() == {}
    clocks.lines = ["2026/12/04 21:00:00.000, 1980, 512.3", "2026/12/04 21:00:00.600, 1755, 699.1",
                    "2026/12/04 21:00:00.800, [N/A], 12.0",  # a sample nvidia-smi could not read is skipped
                    "2026/12/04 21:00:01.200, 1830, 650.0"]
    summary = clocks.summary()
    assert summary["samples"] == 3 and summary["sm_mhz_min"] == 1755 and summary["sm_mhz_median"] == 1830, summary
    assert summary["power_w_max"] == 699.1, summary
    later = clocks.summary(skip_s=0.5)  # the samples of the first half second left out
    assert later["samples"] == 2 and later["sm_mhz_max"] == 1830, later
