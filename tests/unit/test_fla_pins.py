"""The pinning of fla's forward configurations (``linear_attention._pin_fla_kernels``), with
stand-in autotuners: on an sm_90 GPU each tuner keeps exactly its pinned configuration, a tuner
that no longer offers it keeps its own list, and elsewhere nothing changes."""

import sys
from types import SimpleNamespace

import pytest
import torch

from model_runtime.kernels import linear_attention as la


def config(num_warps, num_stages=3, **kwargs):
    return SimpleNamespace(kwargs=kwargs, num_warps=num_warps, num_stages=num_stages)


class Tuner:
    def __init__(self, configs):
        self.configs = list(configs)
        self.cache = {("key",): self.configs[0]}


def offered():
    """Per kernel: the pinned configuration among others, as fla offers them on Hopper."""
    out = {}
    for name, pin in la.FLA_FORWARD_PINS.items():
        meta = {k: v for k, v in pin.items() if k not in ("num_warps", "num_stages")}
        pinned = config(pin["num_warps"], pin.get("num_stages", 3), **meta)
        out[name] = [config(pin["num_warps"] * 2, 2, **meta), pinned, config(1, 4, **{k: v // 2 for k, v in meta.items()})]
    return out


@pytest.fixture
def tuners(monkeypatch):
    made = {name: Tuner(cs) for name, cs in offered().items()}
    monkeypatch.setattr(la, "fla_tuner", made.get)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("PACKSCORE_FLA_AUTOTUNE", raising=False)
    return made


def test_config_matches_every_given_field():
    c = config(4, 3, BK=64, BV=64)
    assert la.config_matches(c, {"BK": 64, "num_warps": 4})
    assert la.config_matches(c, {"BK": 64, "BV": 64, "num_warps": 4, "num_stages": 3})
    assert not la.config_matches(c, {"BK": 32, "num_warps": 4})
    assert not la.config_matches(c, {"BK": 64, "num_stages": 4})
    assert not la.config_matches(config(4), {"BT": 8, "num_warps": 4})  # a meta-parameter it lacks


def test_on_hopper_every_tuner_keeps_its_pin_alone(tuners, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert set(la._pin_fla_kernels.__wrapped__()) == set(la.FLA_FORWARD_PINS)
    for name, tuner in tuners.items():
        assert len(tuner.configs) == 1, f"{name}: {len(tuner.configs)} configurations left"
        assert la.config_matches(tuner.configs[0], la.FLA_FORWARD_PINS[name]), name
        assert tuner.cache == {}, f"{name}: an earlier pick stayed in the tuner's cache"


def test_a_pin_fla_no_longer_offers_leaves_that_kernel_tuned_and_says_so(tuners, monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    tuners["kkt_solve"].configs = [c for c in tuners["kkt_solve"].configs
                                   if not la.config_matches(c, la.FLA_FORWARD_PINS["kkt_solve"])]
    before = list(tuners["kkt_solve"].configs)
    with caplog.at_level("WARNING", logger=la.__name__):
        assert "kkt_solve" not in la._pin_fla_kernels.__wrapped__()
    assert tuners["kkt_solve"].configs == before
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "kkt_solve" in said and "other bits" in said, said


def test_without_fla_l2norm_kernel_the_fallback_is_logged(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "fla.modules.norm.l2norm", None)  # an fla without the kernel
    monkeypatch.setattr(la, "_L2NORM_KERNEL", None)
    with caplog.at_level("WARNING", logger=la.__name__):
        assert la._l2norm_fixed_key(torch.ones(4, 2, 8)) is None
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "l2norm_fwd_kernel" in said and "inside the delta rule" in said, said


@pytest.mark.parametrize("capability, autotune", [((8, 0), None), ((10, 0), None), ((9, 0), "1")])
def test_other_gpus_and_the_opt_out_keep_fla_autotuning(tuners, monkeypatch, caplog, capability, autotune):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    if autotune:
        monkeypatch.setenv("PACKSCORE_FLA_AUTOTUNE", autotune)
    with caplog.at_level("WARNING", logger=la.__name__):
        assert la._pin_fla_kernels.__wrapped__() == ()
    assert all(len(t.configs) == 3 for t in tuners.values())
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "other bits" in said and ("PACKSCORE_FLA_AUTOTUNE=1" if autotune else f"sm_{capability[0]}{capability[1]}") in said, said


def test_pinned_hopper_says_nothing(tuners, monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    with caplog.at_level("WARNING", logger=la.__name__):
        la._pin_fla_kernels.__wrapped__()
    assert not caplog.records, [r.getMessage() for r in caplog.records]
