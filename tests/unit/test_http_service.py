"""The service around the scheduler: auth, readiness phases, draining, metrics, /v1/models, OpenAPI."""

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from model_runtime.scoring.backend import BackendUnavailableError
from service.http.app import create_app
from service.http.schemas import ModelList
from service.settings import Settings
from service.testing import FakeBackend, running_app, wait_until

GOOD = {"sequences": [{"id": "a", "input_ids": [1, 2, 3, 4], "score_from": 2}]}
KEY = "s3cret-key"

pytestmark = pytest.mark.usefixtures("no_packscore_env")


def test_api_key_guards_every_route_but_the_probes(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")

    async def main():
        app = create_app(Settings(api_key_file=key_file), FakeBackend())
        async with running_app(app) as client:
            bearer = {"Authorization": f"Bearer {KEY}"}
            out = {
                "no-key": await client.post("/score", json=GOOD),
                "wrong-key": await client.post("/score", json=GOOD, headers={"Authorization": "Bearer nope"}),
                "wrong-scheme": await client.post("/score", json=GOOD, headers={"Authorization": f"Basic {KEY}"}),
                "right-key": await client.post("/score", json=GOOD, headers=bearer),
                "lowercase-scheme": await client.post("/v1/score", json=GOOD, headers={"Authorization": f"bearer {KEY}"}),
                "healthz": await client.get("/healthz"),
                "health": await client.get("/health"),
                "readyz": await client.get("/readyz"),
                "metrics": await client.get("/metrics"),
                "models": await client.get("/v1/models"),
                "openapi": await client.get("/openapi.json"),
                "metrics-key": await client.get("/metrics", headers=bearer),
                "unknown-route": await client.get("/nope"),
                "post-healthz": await client.post("/healthz"),  # only GET (and HEAD) is open
                "post-healthz-key": await client.post("/healthz", headers=bearer),
                "head-readyz": await client.head("/readyz"),
            }
            return out

    out = asyncio.run(main())
    assert out["post-healthz-key"].status_code == 405 and out["head-readyz"].status_code == 200
    for name in ("no-key", "wrong-key", "wrong-scheme", "metrics", "models", "openapi", "unknown-route", "post-healthz"):
        assert out[name].status_code == 401, name
        assert out[name].json()["error"]["type"] == "unauthorized"
        assert out[name].headers["www-authenticate"] == "Bearer"
    for name in ("right-key", "lowercase-scheme", "healthz", "health", "readyz", "metrics-key"):
        assert out[name].status_code == 200, (name, out[name].text)
    assert out["health"].json() == out["healthz"].json() == {"status": "ok"}


def test_api_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("PACKSCORE_API_KEY", KEY)

    async def main():
        app = create_app(Settings(), FakeBackend())
        async with running_app(app) as client:
            return (await client.post("/score", json=GOOD)).status_code, (
                await client.post("/score", json=GOOD, headers={"Authorization": f"Bearer {KEY}"})
            ).status_code

    assert asyncio.run(main()) == (401, 200)


def test_readiness_follows_loading_then_a_real_scoring_pass():
    loaded = threading.Event()
    backend = FakeBackend()

    def load():
        loaded.wait(timeout=10)
        return backend

    async def main():
        app = create_app(Settings(), load)
        async with running_app(app, ready=False) as client:
            during = {
                "healthz": await client.get("/healthz"),
                "readyz": await client.get("/readyz"),
                "score": await client.post("/score", json=GOOD),
                "models": await client.get("/v1/models"),
            }
            loaded.set()
            await wait_until(lambda: app.state.service.phase == "ready")
            after = await client.get("/readyz")
            return during, after

    during, after = asyncio.run(main())
    assert during["healthz"].status_code == 200 and during["healthz"].json() == {"status": "ok"}
    assert during["readyz"].status_code == 503 and during["readyz"].json()["status"] == "loading"
    assert during["readyz"].headers["retry-after"].isdigit()
    assert during["score"].status_code == 503 and during["score"].json()["error"]["type"] == "not_ready"
    assert "retry-after" in during["score"].headers
    assert during["models"].status_code == 503
    assert after.status_code == 200 and after.json()["status"] == "ready"
    assert after.json()["limits"]["max_model_len"] == 4096
    # The readiness pass went through the backend: it is a real forward, not a flag.
    assert backend.rows and backend.rows[0] == [8]


def test_readyz_answers_within_its_wait_while_a_long_forward_runs_and_reports_a_stall(monkeypatch):
    """Its scoring pass waits behind a running row: /readyz answers within its wait, ready while
    the forward is within what it should take (proven before), 503 "stalled" past that."""
    import service.readiness as readiness
    import service.scheduling.forward_thread as forward_thread

    monkeypatch.setattr(readiness, "_READY_MAX_AGE_S", 0.0)  # every /readyz wants a fresh pass
    monkeypatch.setattr(readiness, "_READY_WAIT_S", 0.3)
    gate = threading.Event()
    backend = FakeBackend()

    async def main():
        app = create_app(Settings(max_wait_ms=0), backend)
        async with running_app(app) as client:
            backend.gate = gate  # the next forward holds until set
            long = asyncio.ensure_future(client.post("/score", json=GOOD))
            await wait_until(lambda: app.state.service.scheduler.forward_running)
            t0 = time.monotonic()
            busy = await client.get("/readyz")
            busy_s = time.monotonic() - t0
            monkeypatch.setattr(forward_thread, "STALL_UNMEASURED_S", 0.0)
            monkeypatch.setattr(forward_thread, "STALL_FLOOR_S", 0.0)
            monkeypatch.setattr(forward_thread, "STALL_FACTOR", 0.0)
            stalled = await client.get("/readyz")
            gate.set()
            scored = await long
            await wait_until(lambda: not app.state.service.scheduler.forward_running)
            after = await client.get("/readyz")
            return busy, busy_s, stalled, scored, after

    busy, busy_s, stalled, scored, after = asyncio.run(main())
    assert busy.status_code == 200 and busy_s < 2, (busy.text, busy_s)
    assert stalled.status_code == 503 and stalled.json()["status"] == "stalled", stalled.text
    assert scored.status_code == 200 and after.status_code == 200, after.text


def test_readyz_reports_a_stalled_forward_even_while_the_last_proof_is_fresh(monkeypatch):
    """One data-parallel replica stuck while another keeps succeeding: the fresh successes must
    not hide the stall (no new pass would run to find it)."""
    import service.scheduling.forward_thread as forward_thread

    gate = threading.Event()
    backend = FakeBackend()

    async def main():
        app = create_app(Settings(max_wait_ms=0), backend)
        async with running_app(app) as client:
            backend.gate = gate
            long = asyncio.ensure_future(client.post("/score", json=GOOD))
            await wait_until(lambda: app.state.service.scheduler.forward_running)
            monkeypatch.setattr(forward_thread, "STALL_UNMEASURED_S", 0.0)
            monkeypatch.setattr(forward_thread, "STALL_FLOOR_S", 0.0)
            monkeypatch.setattr(forward_thread, "STALL_FACTOR", 0.0)
            t0 = time.monotonic()
            stalled = await client.get("/readyz")
            stalled_s = time.monotonic() - t0
            gauge_stalled = _ready_gauge((await client.get("/metrics")).text)
            gate.set()
            await long
            await wait_until(lambda: not app.state.service.scheduler.forward_running)
            return stalled, stalled_s, gauge_stalled, _ready_gauge((await client.get("/metrics")).text)

    stalled, stalled_s, gauge_stalled, gauge_after = asyncio.run(main())
    assert stalled.status_code == 503 and stalled.json()["status"] == "stalled", stalled.text
    assert stalled_s < 1.0, f"{stalled_s:.2f} s"
    # packscore_ready says what /readyz would answer (alerts read it): 0 while stalled, 1 once the forward ends
    assert (gauge_stalled, gauge_after) == (0.0, 1.0), (gauge_stalled, gauge_after)


def _ready_gauge(metrics: str) -> float:
    return float(next(line.split()[1] for line in metrics.splitlines() if line.startswith("packscore_ready ")))


def test_a_failed_load_is_reported_not_hidden():
    def load():
        raise FileNotFoundError("no such checkpoint")

    async def main():
        app = create_app(Settings(), load)
        async with running_app(app) as client:
            return app.state.service.fatal_error, await client.get("/readyz")

    fatal, readyz = asyncio.run(main())
    assert "no such checkpoint" in fatal
    assert readyz.status_code == 503 and readyz.json()["status"] == "failed"


def test_a_worker_pool_that_could_not_start_fails_in_one_line_naming_why(caplog):
    # The pool's message names the worker and how it ended; the load thread's traceback adds nothing.
    why = "the worker pool did not start: a worker was lost at each of 3 attempts, the last: worker rank 1 (pid 7) was killed by SIGKILL while starting"

    def load():
        raise BackendUnavailableError(why)

    async def main():
        app = create_app(Settings(), load)
        async with running_app(app):
            return app.state.service.fatal_error

    assert asyncio.run(main()) == why
    failed = [r for r in caplog.records if r.name == "service.runtime" and "startup failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].exc_info is None and why in failed[0].getMessage(), caplog.text


def test_drain_finishes_admitted_requests_and_refuses_new_ones():
    async def main():
        gate = threading.Event()
        backend = FakeBackend()
        app = create_app(Settings(max_batch_tokens=16, max_wait_ms=0, drain_timeout_s=10), backend)
        service = app.state.service
        async with running_app(app) as client:
            backend.gate = gate
            admitted = [asyncio.ensure_future(client.post("/score", json=GOOD)) for _ in range(3)]
            await wait_until(lambda: service.scheduler.pending_requests == 3)
            drain = asyncio.ensure_future(service.drain())
            await asyncio.sleep(0.05)
            during = {
                "score": await client.post("/score", json=GOOD),
                "readyz": await client.get("/readyz"),
                "healthz": await client.get("/healthz"),
                "metrics": await client.get("/metrics"),
            }
            assert not drain.done()
            gate.set()
            await drain
            return [await a for a in admitted], during, service.drained

    admitted, during, drained = asyncio.run(main())
    assert [r.status_code for r in admitted] == [200, 200, 200]
    assert during["score"].status_code == 503 and during["score"].json()["error"]["type"] == "draining"
    assert during["score"].headers["retry-after"] == "1"
    assert during["readyz"].status_code == 503 and during["readyz"].json()["status"] == "draining"
    assert during["healthz"].status_code == 200 and during["metrics"].status_code == 200
    assert drained


def test_drain_timeout_answers_what_is_left_with_503():
    async def main():
        gate = threading.Event()
        backend = FakeBackend()
        app = create_app(Settings(max_batch_tokens=4, max_wait_ms=0, drain_timeout_s=0.2), backend)
        service = app.state.service
        async with running_app(app) as client:
            backend.gate = gate
            stuck = [asyncio.ensure_future(client.post("/score", json=GOOD)) for _ in range(3)]
            await wait_until(lambda: service.scheduler.pending_requests == 3)
            await service.drain()
            results = [await s for s in stuck[1:]]  # the first is inside a forward that never ends
            gate.set()
            return results

    results = asyncio.run(main())
    assert all(r.status_code == 503 and "retry-after" in r.headers for r in results)



def test_drain_finishes_a_weight_update_in_progress(tmp_path):
    """An update in progress at SIGTERM is admitted work: the drain waits for it and its answer
    (else the exit cuts it off into uvicorn's plain-text 500, the trainer not knowing what serves)."""
    (tmp_path / "step-1").mkdir()

    async def main():
        gate = threading.Event()
        backend = FakeBackend()
        backend.load_gate = gate
        app = create_app(Settings(weights_root=tmp_path, drain_timeout_s=10), backend)
        service = app.state.service
        async with running_app(app) as client:
            update = asyncio.ensure_future(client.post("/v1/weights", json={"path": "step-1", "version": "v1"}))
            await wait_until(lambda: service.default.updating)
            drain = asyncio.ensure_future(service.drain())
            await asyncio.sleep(0.2)
            waited = not drain.done()
            gate.set()
            await drain
            return waited, await update

    waited, update = asyncio.run(main())
    assert waited, "the drain ended while the update was still running"
    assert update.status_code == 200 and update.json()["weights_version"] == "v1", update.text

REQUIRED = {
    "packscore_requests_total": {"route", "status"},
    "packscore_tokens_scored_total": {"model"},
    "packscore_rejections_total": {"reason"},
    "packscore_request_latency_seconds_bucket": {"route", "le"},
    "packscore_queue_wait_seconds_bucket": {"model", "le"},
    "packscore_forward_seconds_bucket": {"model", "le"},
    "packscore_batch_tokens_bucket": {"model", "le"},
    "packscore_batch_fill_ratio_bucket": {"model", "le"},
    "packscore_queued_tokens": set(),
    "packscore_queued_sequences": set(),
    "packscore_ready": set(),
    "packscore_workers_alive": set(),
    "packscore_model_info": {"model", "architecture", "dtype", "device", "weights_version"},
    "packscore_kernel_info": {"model", "family", "backend"},
    "packscore_slow_kernel_fallback": {"model"},
    "packscore_parallel_info": {"model", "world_size", "dp", "sp", "fsdp"},
    "packscore_process_cpu_seconds_total": set(),
    "packscore_process_resident_memory_bytes": set(),
    "packscore_process_open_fds": set(),
}


def test_metrics_names_labels_and_values():
    async def main():
        app = create_app(Settings(max_batch_tokens=100), FakeBackend())
        other = create_app(Settings(), FakeBackend())  # a second app: its own registry, no clash
        async with running_app(app) as client:
            await client.post("/score", json=GOOD)
            await client.post("/score", json={"sequences": []})
            return (await client.get("/metrics")), other

    response, _ = asyncio.run(main())
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        assert family.name.startswith("packscore_"), family.name
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    for name, labels in REQUIRED.items():
        assert name in samples, f"missing {name}"
        assert any(set(s.labels) == labels for s in samples[name]), (name, [s.labels for s in samples[name]])

    def value(name, **labels):
        return next(s.value for s in samples[name] if all(s.labels.get(k) == v for k, v in labels.items()))

    assert value("packscore_requests_total", route="/score", status="200") == 1
    assert value("packscore_requests_total", route="/score", status="422") == 1
    assert value("packscore_rejections_total", reason="invalid_value") == 1
    assert value("packscore_tokens_scored_total") == 2  # this request's 2; the readiness pass is not traffic
    assert value("packscore_ready") == 1 and value("packscore_workers_alive") == 1
    assert value("packscore_model_info", model="fake-model", device="cpu") == 1
    assert value("packscore_kernel_info", family="attention", backend="reference") == 1
    assert value("packscore_parallel_info", world_size="1", fsdp="false") == 1
    assert value("packscore_slow_kernel_fallback") == 0
    # Every per-model series names the served model; no _created series; the process's own figures.
    for name in ("packscore_tokens_scored_total", "packscore_forward_seconds_count", "packscore_kernel_info",
                 "packscore_model_info", "packscore_parallel_info", "packscore_slow_kernel_fallback"):
        assert {s.labels.get("model") for s in samples[name]} == {"fake-model"}, (name, samples[name])
    assert not [name for name in samples if name.endswith("_created")]
    assert "_created" not in response.text
    assert value("packscore_process_resident_memory_bytes") > 0 and value("packscore_process_cpu_seconds_total") > 0


def test_models_route_has_the_contract_shape():
    async def main():
        app = create_app(Settings(served_model_name="served", max_model_len=1024), FakeBackend(max_model_len=4096))
        async with running_app(app) as client:
            ok = await client.post("/score", json={**GOOD, "model": "served"})
            return (await client.get("/v1/models")).json(), ok.json()["model"]

    body, answered_model = asyncio.run(main())
    ModelList.model_validate(body)
    (card,) = body["data"]
    assert set(card) == {"id", "architecture", "vocab_size", "max_model_len", "dtype", "device", "parallel",
                         "kernels", "weights_version"}
    assert card["id"] == answered_model == "served"
    assert card["max_model_len"] == 1024
    assert card["parallel"] == {"world_size": 1, "dp": 1, "sp": 1, "fsdp": False}


def test_max_model_len_beyond_the_model_is_refused_at_startup():
    async def main():
        app = create_app(Settings(max_model_len=8192), FakeBackend(max_model_len=4096))
        async with running_app(app):
            return app.state.service.fatal_error

    assert "exceeds" in asyncio.run(main())


def test_openapi_documents_both_encodings_examples_and_error_bodies():
    async def main():
        app = create_app(Settings(), FakeBackend())
        async with running_app(app) as client:
            return (await client.get("/openapi.json")).json()

    schema = asyncio.run(main())
    for path in ("/score", "/v1/score"):
        operation = schema["paths"][path]["post"]
        assert set(operation["requestBody"]["content"]) == {"application/json", "application/msgpack"}
        assert set(operation["responses"]["200"]["content"]) == {"application/json", "application/msgpack"}
        assert {"400", "401", "404", "413", "422", "429", "503", "504"} <= set(operation["responses"])
        assert "Retry-After" in operation["responses"]["429"]["headers"]
    components = schema["components"]["schemas"]
    assert components["ScoreRequest"]["examples"] and components["ScoreResponse"]["examples"]
    assert "HTTPValidationError" not in components  # FastAPI's own 422 format is not part of the API


def test_extreme_temperatures_answer_numbers_not_nulls():
    """Any finite temperature > 0 is valid (docs/api.md); at 5e-324 the fuzzer once got nulls back."""
    import math

    from model_runtime.kernels.logprob_head import LOGP_FLOOR
    from model_runtime.scoring.backend import LocalBackend
    from model_runtime.scoring.loading import load_model
    from model_runtime.scoring.scorer import Scorer

    backend = LocalBackend(Scorer(load_model("tiny", device="cpu")))

    async def main():
        app = create_app(Settings(), backend)
        async with running_app(app) as client:
            answers = {}
            for t in (5e-324, 1e-40, 1e-30, 1e300):
                body = {"sequences": [{"input_ids": [228, 418, 7, 9]}], "temperature": t, "top_k": 2}
                r = await client.post("/score", json=body)
                assert r.status_code == 200, r.text
                answers[t] = r.json()["results"][0]
            return answers

    for t, result in asyncio.run(main()).items():
        numbers = result["logprobs"] + result["entropy"] + [x for row in result["top_k_logprobs"] for x in row]
        assert all(isinstance(x, float) and math.isfinite(x) for x in numbers), f"T={t}: {result}"
        assert all(x >= LOGP_FLOOR for x in result["logprobs"]) and all(h >= 0 for h in result["entropy"])


def test_a_trailing_slash_is_a_json_404_naming_the_route_and_405_allows_head():
    async def main():
        async with running_app(create_app(Settings(), FakeBackend())) as client:
            return (await client.post("/score/", json=GOOD), await client.get("/healthz/"),
                    await client.post("/healthz"), await client.delete("/metrics"))

    slash, health_slash, post_health, delete_metrics = asyncio.run(main())
    for answer, route in ((slash, "/score"), (health_slash, "/healthz")):
        assert answer.status_code == 404, answer.text  # not a redirect a client may not follow
        assert f"did you mean {route}?" in answer.json()["error"]["message"], answer.text
    for answer in (post_health, delete_metrics):
        assert answer.status_code == 405 and answer.json()["error"]["type"] == "method_not_allowed", answer.text
        assert {m.strip() for m in answer.headers["allow"].split(",")} == {"GET", "HEAD"}, answer.headers


def test_a_wrong_method_on_score_is_the_405_the_usage_doc_shows():
    async def main():
        async with running_app(create_app(Settings(), FakeBackend())) as client:
            return await client.get("/score"), await client.head("/score")

    get, head = asyncio.run(main())
    usage = (Path(__file__).resolve().parents[2] / "docs" / "usage.md").read_text()
    for answer in (get, head):
        assert answer.status_code == 405 and answer.headers["allow"] == "POST", (answer, answer.headers)
    assert head.content == b"" and f"`{json.dumps(get.json())}`" in usage, get.text

def _overflow(loaded) -> None:
    """Finite head weights whose logits overflow float32: NaN log-probs (the start-up readiness
    pass refuses such weights, so they are set once the server is ready)."""
    import torch

    with torch.no_grad():
        loaded.model.lm_head.weight.copy_(torch.sign(loaded.model.lm_head.weight) * 3e38)


def test_non_finite_scores_are_a_422_naming_the_sequence_not_nulls(monkeypatch, tmp_path, capsys):
    """JSON cannot carry NaN (orjson writes null) and a trainer must not average it in."""
    import orjson

    from service import cli

    from model_runtime.scoring.backend import LocalBackend
    from model_runtime.scoring.loading import load_model
    from model_runtime.scoring.scorer import Scorer

    loaded = load_model("tiny", device="cpu")
    backend = LocalBackend(Scorer(loaded))

    async def main():
        async with running_app(create_app(Settings(), backend)) as client:
            _overflow(loaded)
            return [await client.post("/score", json={"sequences": [{"input_ids": [1, 5, 2]}]}, headers=headers)
                    for headers in ({}, {"Accept": "application/msgpack"})]

    for answer in asyncio.run(main()):
        assert answer.status_code == 422, answer.text
        error = answer.json()["error"]
        assert error["type"] == "non_finite_scores" and error["param"] == "sequences[0]", error
        assert "logprobs[0]" in error["message"], error
    monkeypatch.setattr("service.backends.load_backend", lambda settings: backend)  # no readiness pass offline
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(orjson.dumps({"id": "a", "input_ids": [1, 5, 2]}) + b"\n")
    assert cli.main(["score", str(source), "-o", str(out)]) == 2
    assert "id 'a' could not be scored: its scores are not finite at logprobs[0]" in capsys.readouterr().err
    assert not out.exists()  # nothing written: the refused first run removed the OUT it created


def test_a_request_the_read_timeout_answered_408_is_counted_408_whatever_its_handler_answers_later():
    # A route that answers without reading its body (GET /readyz waiting up to 4 s for a probe) and
    # whose declared body stalls: the protocol sends 408 and closes at the read timeout, the
    # handler's later 200 goes nowhere, and was what packscore_requests_total counted.
    from service.http.app import _Gate
    from service.http.protocol import PROTOCOL_ANSWER

    service = create_app(Settings(), FakeBackend()).state.service

    async def handler(scope, receive, send):
        scope[PROTOCOL_ANSWER] = 408  # as GuardedH11Protocol sets it when it answered 408
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        pass

    scope = {"type": "http", "path": "/readyz", "method": "GET", "headers": []}
    asyncio.run(_Gate(handler, service)(scope, receive, send))
    counted = service.metrics.registry.get_sample_value("packscore_requests_total", {"route": "/readyz", "status": "408"})
    assert counted == 1.0, [line for line in service.metrics.render().decode().splitlines() if "requests_total{" in line]


@pytest.mark.parametrize("max_request_bytes,limit", [(None, 1 << 20), (4096, 4096)])
def test_the_weights_route_s_413_names_its_own_limit(tmp_path, max_request_bytes, limit):
    """The lower of 1 MiB and --max-request-bytes, not max_request_bytes alone (36 MiB by default)."""

    async def main():
        app = create_app(Settings(weights_root=tmp_path, max_request_bytes=max_request_bytes), FakeBackend())
        async with running_app(app) as client:
            return await client.post("/v1/weights", json={"path": "x" * (limit + 10)})

    answer = asyncio.run(main())
    assert answer.status_code == 413, answer.text
    assert answer.json()["error"]["message"] == (f"The body exceeds {limit} bytes (the lower of 1 MiB and "
                                                 "max_request_bytes); a weights request holds a model, a path and "
                                                 "a version."), answer.text


@pytest.mark.parametrize("timeout_s,said", [(0.5, "within 0.5s"), (30.0, "within 30s")])
def test_the_drain_line_gives_its_timeout_as_set(caplog, timeout_s, said):
    async def main():
        app = create_app(Settings(drain_timeout_s=timeout_s), FakeBackend())
        async with running_app(app):
            with caplog.at_level("INFO", logger="service.runtime"):
                app.state.service.begin_drain()

    asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if "draining: finishing" in r.getMessage()]
    assert lines == [f"draining: finishing admitted requests {said}"], lines


@pytest.mark.parametrize("phase,said", [("loading", "loading"), ("warming_up", "warming up"), ("probing", "probing")])
def test_a_drain_during_the_start_says_the_start_stops_not_that_admitted_requests_finish(caplog, phase, said):
    service = create_app(Settings(), FakeBackend()).state.service
    service.phase = phase  # the start's: nothing admitted yet
    with caplog.at_level("INFO", logger="service.runtime"):
        service.begin_drain()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("draining:")]
    assert lines == [f"draining: stopping the model's start ({said}); no request was admitted yet"], lines


@pytest.mark.parametrize("phase,said", [("loading", "loading"), ("warming_up", "warming up"), ("probing", "probing")])
def test_a_stop_without_a_drain_during_the_start_says_the_start_stops_not_that_admitted_requests_get_503(caplog, phase,
                                                                                                         said):
    service = create_app(Settings(), FakeBackend()).state.service
    service.phase = phase  # the start's: nothing admitted yet
    with caplog.at_level("INFO", logger="service.runtime"):
        service.begin_drain(abandoning=True)
    lines = [r.getMessage() for r in caplog.records if "stopping" in r.getMessage()]
    assert lines == [f"stopping the model's start ({said}) at once, without a drain; no request was admitted yet"], lines
