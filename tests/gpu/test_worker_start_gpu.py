"""A pool rank's start-up measures on a GPU (the prefix rounding, the narrow products' runs) with the real
probes: tests/unit/test_start_lines.py drives the same functions with stand-ins, which only a GPU runs."""

import logging

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _start(prefix_min_tokens: int):
    from model_runtime.pool import messages as msg

    return msg.Start(rank=0, world_size=1, sp=1, fsdp=False, master_port=1, generation=1, model="tiny",
                     device="cuda", dtype="bfloat16", max_batch_tokens=2048, allow_slow_kernels=True, kernels={},
                     served_model_name="tiny", timeout_s=60.0, prefix_min_tokens=prefix_min_tokens)


def test_a_ranks_start_measures_run_the_real_probes_and_say_their_lines(caplog):
    from model_runtime.parallel.dims import ParallelDims
    from model_runtime.pool import worker
    from model_runtime.scoring import rounding
    from model_runtime.scoring.loading import load_model

    caplog.set_level(logging.INFO, logger="packscore.worker")
    device = torch.device("cuda", 0)
    loaded = load_model("tiny", device="cuda:0", dtype="bfloat16", served_name="tiny", allow_slow_kernels=True)
    measured = worker._prefix_rounding(_start(64), ParallelDims.from_world(1, 1, False), loaded, device)
    assert isinstance(measured, rounding.RowRounding) and measured.kind_count >= 1, measured
    worker._narrow_runs(_start(64), loaded, device)
    lines = [r.getMessage() for r in caplog.records if r.name == "packscore.worker"]
    assert lines[0].startswith("measuring the prefix rounding of tiny on cuda:0: "), lines
    assert lines[1].startswith("measured the prefix rounding of tiny in ") and lines[1].endswith(
        f"s: {measured.kind_count} kinds of length"), lines
    if rounding.measures_runs(loaded, device):  # the GPU's default backend for the narrow products
        assert lines[2].startswith("measuring the narrow products' runs of tiny on cuda:0: "), lines
        assert lines[3].startswith("measured the narrow products' runs of tiny in "), lines
        assert all(m.run_limits.rows for m in loaded.model.modules() if hasattr(m, "narrow_weights"))
    else:
        assert lines[2:] == [], lines
