"""The suite's markdown says how warm the kernel caches were when it quotes the start-up warm-up."""

import pytest

from bench.report import markdown


def results(**bench_extra) -> dict:
    bench = {"workload": {"sequences": 2, "tokens": 100, "scored_tokens": 90, "mean_length": 50, "max_length": 60},
             "model_tflop": 1.0, "ceiling_tflops": 700.0, "warm_up_s": 9.7,
             "sides": {"packscore": {"tokens_per_s": 1000.0, "model_tflops": 500.0, "mfu_of_measured_peak": 0.7,
                                     "peak_memory_gib": 1.0}}, **bench_extra}
    return {"ceiling": {"tflops_mean": 700.0}, "qwen3.5-9b": bench}


@pytest.mark.parametrize("files, says", [(0, "with empty kernel caches"), (1234, "with 1,234 files in the kernel caches"),
                                         (None, "with the kernel caches as the run found them")])
def test_the_warm_up_names_the_caches_it_started_from(files, says):
    text = markdown(results(kernel_cache_files_at_start=files))
    assert f"start-up warm-up 10 s {says}" in text, text


def test_an_older_result_without_the_count_claims_no_empty_cache():
    assert "empty kernel caches" not in markdown(results())
