"""No silent slow path on CUDA: with fla missing, start-up refuses unless slow kernels are allowed,
and whatever runs is named in the model's backends (what /v1/models and the metrics show)."""

import pytest
import torch

import model_runtime.kernels.registry as kernels
from model_runtime.kernels.registry import SlowKernelError, select_backends

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="backend selection on CUDA needs CUDA"),
]


@pytest.fixture
def without_fla(monkeypatch):
    real = kernels._unavailable_reason

    def reason(family, name, library=None):
        return "fla is not installed (hidden by the test)" if name == "fla" else real(family, name, library)

    monkeypatch.setattr(kernels, "_unavailable_reason", reason)


def test_fast_backends_chosen_on_this_machine(gpu_record):
    chosen = select_backends("cuda")
    gpu_record("backends on this machine", **chosen.names)
    assert chosen.linear_attention == "fla"
    assert chosen.conv1d in ("triton", "causal_conv1d")
    assert chosen.attention == "sdpa_fused"
    assert select_backends("cuda", worker_pool=True).attention in ("varlen", "flash_attn")
    assert chosen.head == "triton" and chosen.elementwise == "triton_exact"
    assert chosen.fallbacks == ()


def test_missing_fla_refuses_to_start(without_fla):
    from model_runtime.scoring.loading import load_model

    with pytest.raises(SlowKernelError, match="--allow-slow-kernels"):
        select_backends("cuda")
    with pytest.raises(SlowKernelError, match="linear_attention"):
        load_model("tiny", device="cuda")


def test_missing_fla_allowed_is_visible(without_fla, gpu_record):
    from model_runtime.scoring.backend import ModelInfo
    from model_runtime.scoring.loading import load_model

    loaded = load_model("tiny", device="cuda", allow_slow_kernels=True)
    info = ModelInfo.of(loaded)
    gpu_record("backends with fla hidden and --allow-slow-kernels", **info.kernels, slow=",".join(info.slow_kernels))
    assert info.kernels["linear_attention"] == "reference"
    # the conv needs no fla (Triton's own kernel, or the causal-conv1d package)
    assert "linear_attention" in info.slow_kernels and "conv1d" not in info.slow_kernels
