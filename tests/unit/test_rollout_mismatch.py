"""Rollout mismatch with the fake backend: the figures of API.md's ``mismatch`` against a plain
loop, their Prometheus histograms, and the 422s of bad ``rollout_logprobs``."""

import asyncio
import json
import math
import re

import msgpack
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.http.app import create_app
from service.http.rollout import mismatch
from service.settings import Settings
from service.testing import FakeBackend, running_app
from tests.unit.trainer_service import expected_logprobs, two_models

pytestmark = pytest.mark.usefixtures("no_packscore_env")


def _mismatch_reference(p, r) -> dict:
    d = [float(a) - float(b) for a, b in zip(np.float32(p), np.float32(r))]
    if not d:
        return {"mean_abs_diff": 0.0, "max_abs_diff": 0.0, "k3_kl": 0.0}
    return {"mean_abs_diff": sum(abs(x) for x in d) / len(d), "max_abs_diff": max(abs(x) for x in d),
            "k3_kl": sum(math.exp(x) - 1 - x for x in d) / len(d)}


def test_mismatch_matches_a_plain_loop_on_random_inputs():
    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 300):
        p = -rng.exponential(2.0, n).astype(np.float32)
        r = (p + rng.normal(0, 0.3, n)).astype(np.float32)
        got, want = mismatch(p, r), _mismatch_reference(p, r)
        for key in want:
            # float32, as every number of the answer (API.md): the plain loop's float64, rounded
            assert got[key] == float(np.float32(want[key])), f"n={n} {key}: {got[key]} vs {want[key]} rounded to float32"


def test_mismatch_stays_a_number_when_exp_overflows():
    figures = mismatch(np.array([-1.0, -2.0], np.float32), np.array([-3e38, -2.0], np.float32))
    assert all(math.isfinite(v) for v in figures.values()), figures
    assert figures["k3_kl"] == float(np.finfo(np.float32).max) and figures["max_abs_diff"] > 1e38


def test_a_huge_mismatch_leaves_the_histograms_sums_finite_and_moving():
    from service.http.metrics import Metrics

    metrics = Metrics()
    huge = mismatch(np.array([-1.0], np.float32), np.array([-3e38], np.float32))
    for figures in (huge, huge, {"mean_abs_diff": 0.25, "max_abs_diff": 0.25, "k3_kl": 0.25}):
        metrics.observe_mismatch("m", figures)
    sums = {s.name: s.value for family in text_string_to_metric_families(metrics.render().decode())
            for s in family.samples if s.name.startswith("packscore_rollout_") and s.name.endswith("_sum")}
    assert len(sums) == 3, sums
    for name, value in sums.items():  # two observations capped at 1,000, then one of 0.25 that still counts
        assert value == 2000.25, f"{name} = {value}, expected 2000.25"


def test_the_mismatch_series_of_every_model_exist_from_the_start():
    async def main():
        async with running_app(create_app(Settings(), two_models())) as client:
            return await client.get("/metrics")

    text = asyncio.run(main()).text
    for model in ("policy", "ref"):
        for name in ("mean_abs_diff", "max_abs_diff", "k3_kl"):
            assert f'packscore_rollout_{name}_count{{model="{model}"}} 0.0' in text, (model, name)


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
def test_rollout_logprobs_give_mismatch_figures(encoding):
    rng = np.random.default_rng(1)
    seqs = [{"id": "a", "input_ids": [3, 9, 27, 81, 5], "score_from": 2}, {"id": "b", "input_ids": [7, 8], "score_from": 2},
            {"id": "c", "input_ids": [1, 2, 3]}]
    rollouts = [(expected_logprobs(seqs[0]) + rng.normal(0, 0.2, 3)).astype(np.float32), np.zeros(0, np.float32), None]

    def wire(r):
        return r.astype("<f4").tobytes() if encoding == "msgpack" else r.tolist()

    sent = [{**s, **({"rollout_logprobs": wire(r)} if r is not None else {})} for s, r in zip(seqs, rollouts)]

    async def main():
        async with running_app(create_app(Settings(), FakeBackend())) as client:
            if encoding == "msgpack":
                packed = [{**s, "input_ids": np.asarray(s["input_ids"], "<i4").tobytes()} for s in sent]
                response = await client.post("/score", content=msgpack.packb({"sequences": packed}),
                                             headers={"Content-Type": "application/msgpack"})
                results = msgpack.unpackb(response.content)["results"]
            else:
                response = await client.post("/score", json={"sequences": sent})
                results = response.json()["results"]
            return response, results, await client.get("/metrics")

    response, results, metrics = asyncio.run(main())
    assert response.status_code == 200
    for seq, rollout, result in zip(seqs, rollouts, results):
        if rollout is None:
            assert "mismatch" not in result
            continue
        want = _mismatch_reference(expected_logprobs(seq), rollout)
        for key, value in want.items():
            # float32, as every number of the answer: JSON's shortest form and msgpack's double both cast back to it
            got = np.float32(result["mismatch"][key])
            assert got == np.float32(value), f"{seq['id']} {key}: {result['mismatch'][key]} vs {value}"
    assert results[1]["mismatch"] == {"mean_abs_diff": 0.0, "max_abs_diff": 0.0, "k3_kl": 0.0}
    # "b" scores nothing: its zeros are in its answer but not in the histograms
    assert 'packscore_rollout_k3_kl_count{model="fake-model"} 1.0' in metrics.text


def test_bad_rollout_logprobs_are_422_naming_the_field():
    cases = {
        "length": ({"input_ids": [1, 2, 3], "score_from": 1, "rollout_logprobs": [-1.0]}, "sequences[0].rollout_logprobs"),
        "nan": ({"input_ids": [1, 2, 3], "rollout_logprobs": [-1.0, float("nan")]}, "sequences[0].rollout_logprobs[1]"),
        "string": ({"input_ids": [1, 2, 3], "rollout_logprobs": [-1.0, "x"]}, "sequences[0].rollout_logprobs[1]"),
        "bool": ({"input_ids": [1, 2, 3], "rollout_logprobs": [True, -1.0]}, "sequences[0].rollout_logprobs[0]"),
    }

    async def main():
        async with running_app(create_app(Settings(), FakeBackend())) as client:
            out = {}
            for name, (seq, _) in cases.items():
                content = json.dumps({"sequences": [seq]}).encode()  # Python's json writes NaN
                out[name] = await client.post("/score", content=content, headers={"Content-Type": "application/json"})
            packed = msgpack.packb({"sequences": [{"input_ids": [1, 2, 3], "rollout_logprobs": b"\0\0\0"}]})
            out["bin"] = await client.post("/score", content=packed, headers={"Content-Type": "application/msgpack"})
            inf = msgpack.packb({"sequences": [{"input_ids": [1, 2, 3], "rollout_logprobs": np.array([0, np.inf], "<f4").tobytes()}]})
            out["bin-inf"] = await client.post("/score", content=inf, headers={"Content-Type": "application/msgpack"})
            return out

    out = asyncio.run(main())
    for name, (_, param) in cases.items():
        assert out[name].status_code == 422, (name, out[name].text)
        assert out[name].json()["error"]["param"] == param, (name, out[name].json())
    assert out["bin"].status_code == 422 and out["bin"].json()["error"]["param"] == "sequences[0].rollout_logprobs"
    assert out["bin-inf"].status_code == 422 and out["bin-inf"].json()["error"]["param"] == "sequences[0].rollout_logprobs[1]"


def test_json_answers_print_mismatch_figures_in_float32s_shortest_form():
    """API.md: every number of the answer is float32: a figure's JSON text is float32's shortest form
    (as the log-probs' is), not the float64 digits of that float32 (0.1 and not 0.10000000149011612)."""
    seq = {"id": "a", "input_ids": [3, 9, 27, 81, 5], "score_from": 1}
    rollout = (expected_logprobs(seq) + np.float32([0.1, -0.3, 0.7, 0.2])).astype(np.float32)

    async def main():
        async with running_app(create_app(Settings(), FakeBackend())) as client:
            return await client.post("/score", json={"sequences": [{**seq, "rollout_logprobs": rollout.tolist()}]})

    response = asyncio.run(main())
    assert response.status_code == 200, response.text
    figures = response.json()["results"][0]["mismatch"]
    for key, value in figures.items():
        text = re.search(rf'"{key}":([^,}}]+)', response.text).group(1)
        assert text == str(np.float32(value)), f"{key}: {text} in the JSON, float32's shortest form is {str(np.float32(value))}"
        assert len(text) < len(repr(float(np.float32(value)))), f"{key}: {text} is not shorter than float64's digits"


def test_float32_figures_leave_the_histograms_sums_in_float64():
    from service.http.metrics import Metrics

    metrics = Metrics()
    # a large figure then a small one: a float32 sum would drop most of the small one's digits
    observed = [mismatch(np.array([-1.0], np.float32), np.array([r], np.float32)) for r in (-301.0, -1.001)]
    for figures in observed:
        metrics.observe_mismatch("m", figures)
    sums = {s.name: s.value for family in text_string_to_metric_families(metrics.render().decode())
            for s in family.samples if s.name.startswith("packscore_rollout_") and s.name.endswith("_sum")}
    want = sum(float(figures["max_abs_diff"]) for figures in observed)  # summed as Python floats
    assert sums["packscore_rollout_max_abs_diff_sum"] == want, (sums, want)
