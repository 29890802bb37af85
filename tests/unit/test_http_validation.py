"""POST /score against a fake backend: the contract's status codes and error bodies, encodings.

Nothing malformed may reach the model: every bad request here is checked to leave the backend
untouched.
"""

import asyncio
import gzip
import json

import msgpack
import numpy as np
import pytest

from model_runtime.types import MAX_TOP_K, SequenceInput
from service.http.app import create_app
from service.http.encoding import response_encoding
from service.http.errors import param_path
from service.http.schemas import MAX_TOP_K as SCHEMA_MAX_TOP_K
from service.http.schemas import ScoreResponse
from service.settings import Settings
from service.testing import FakeBackend, expected_scores, running_app

VOCAB = 1000
LIMITS = dict(max_model_len=64, max_sequences_per_request=8, max_queued_tokens=300, max_request_bytes=20_000)


def make_app(**overrides):
    backend = FakeBackend(vocab_size=VOCAB, max_model_len=4096)
    return create_app(Settings(**{**LIMITS, **overrides}), backend), backend


def good(**extra):
    return {"sequences": [{"id": "a", "input_ids": [1, 2, 3, 4], "score_from": 2}], **extra}


def seq(**fields):
    return {"sequences": [{"input_ids": [1, 2, 3, 4], **fields}]}


JSON_H = {"Content-Type": "application/json"}
MSGPACK_H = {"Content-Type": "application/msgpack"}

# (id, body, status, error type, param). Bodies are Python objects sent as JSON by Python's json
# module, which writes NaN / Infinity literals the way many clients do.
BAD_JSON = [
    ("empty-sequences", {"sequences": []}, 422, "invalid_value", "sequences"),
    ("missing-sequences", {"temperature": 1.0}, 422, "invalid_value", "sequences"),
    ("sequences-not-list", {"sequences": {"input_ids": [1]}}, 422, "invalid_value", "sequences"),
    ("body-is-list", [1, 2], 422, "invalid_value", None),
    ("empty-input-ids", seq(input_ids=[]), 422, "invalid_value", "sequences[0].input_ids"),
    ("missing-input-ids", {"sequences": [{"id": "x"}]}, 422, "invalid_value", "sequences[0].input_ids"),
    ("negative-id", seq(input_ids=[1, -1, 2]), 422, "invalid_value", "sequences[0].input_ids[1]"),
    ("out-of-vocab", seq(input_ids=[1, 2, VOCAB]), 422, "invalid_value", "sequences[0].input_ids[2]"),
    ("huge-id", seq(input_ids=[1, 2**70]), 422, "invalid_value", "sequences[0].input_ids[1]"),
    ("float-id", seq(input_ids=[1, 2.5]), 422, "invalid_value", "sequences[0].input_ids[1]"),
    ("integral-float-id", seq(input_ids=[1, 2.0]), 422, "invalid_value", "sequences[0].input_ids[1]"),
    ("bool-id", seq(input_ids=[1, True]), 422, "invalid_value", "sequences[0].input_ids[1]"),
    ("string-id", seq(input_ids=["7"]), 422, "invalid_value", "sequences[0].input_ids[0]"),
    ("ids-not-list", seq(input_ids="1 2 3"), 422, "invalid_value", "sequences[0].input_ids"),
    ("score-from-0", seq(score_from=0), 422, "invalid_value", "sequences[0].score_from"),
    ("score-from-past-end", seq(score_from=5), 422, "invalid_value", "sequences[0].score_from"),
    ("score-from-string", seq(score_from="2"), 422, "invalid_value", "sequences[0].score_from"),
    ("id-not-string", seq(id=5), 422, "invalid_value", "sequences[0].id"),
    ("unknown-sequence-field", seq(labels=[1]), 422, "invalid_value", "sequences[0].labels"),
    ("unknown-field", good(temprature=0.5), 422, "invalid_value", "temprature"),
    ("empty-key", good(**{"": 1}), 422, "invalid_value", None),
    ("temperature-0", good(temperature=0), 422, "invalid_value", "temperature"),
    ("temperature-negative", good(temperature=-1.0), 422, "invalid_value", "temperature"),
    ("temperature-nan", good(temperature=float("nan")), 422, "invalid_value", "temperature"),
    ("temperature-inf", good(temperature=float("inf")), 422, "invalid_value", "temperature"),
    ("temperature-string", good(temperature="1.0"), 422, "invalid_value", "temperature"),
    ("temperature-bool", good(temperature=True), 422, "invalid_value", "temperature"),
    ("top-k-negative", good(top_k=-1), 422, "invalid_value", "top_k"),
    ("top-k-21", good(top_k=MAX_TOP_K + 1), 422, "invalid_value", "top_k"),
    ("top-k-float", good(top_k=1.5), 422, "invalid_value", "top_k"),
    ("entropy-string", good(return_entropy="yes"), 422, "invalid_value", "return_entropy"),
    ("deadline-0", good(deadline_ms=0), 504, "deadline_exceeded", "deadline_ms"),  # no result is ready after 0 ms
    ("deadline-negative", good(deadline_ms=-1), 422, "invalid_value", "deadline_ms"),
    ("model-not-string", good(model=3), 422, "invalid_value", "model"),
    ("second-sequence-bad", {"sequences": [{"input_ids": [1, 2]}, {"input_ids": [3, 4, 5, 6, 1e9]}]}, 422,
     "invalid_value", "sequences[1].input_ids[4]"),
    ("unknown-model", good(model="nope"), 404, "model_not_found", "model"),
    ("too-long", seq(input_ids=[1] * 65), 413, "sequence_too_long", "sequences[0].input_ids"),
    ("too-many-sequences", {"sequences": [{"input_ids": [1]}] * 9}, 413, "too_many_sequences", "sequences"),
    ("too-many-tokens", {"sequences": [{"input_ids": [1] * 60}] * 6}, 413, "request_too_large", "sequences"),
]


async def _post(client, body, headers=JSON_H):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return await client.post("/score", content=raw, headers=headers)


def _check_error(response, status, kind, param):
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"type", "message", "param"}, body
    assert body["error"]["type"] == kind, body
    assert body["error"]["param"] == param, body
    assert body["error"]["message"], body


async def _each_refused(client, cases):
    """Posts each ``(name, body, headers, status, error type, param)`` case and checks its error body,
    naming the case that fails."""
    for name, body, headers, status, kind, param in cases:
        try:
            _check_error(await _post(client, body, headers), status, kind, param)
        except AssertionError as exc:
            raise AssertionError(f"case {name}: {exc}") from None


def test_bad_json_requests_get_their_status_and_never_reach_the_model():
    async def main():
        app, backend = make_app()
        async with running_app(app) as client:
            rows_before = len(backend.rows)
            await _each_refused(client, [(name, body, JSON_H, *expected) for name, body, *expected in BAD_JSON])
            assert len(backend.rows) == rows_before, "a bad request reached the backend"

    asyncio.run(main())


def test_top_k_past_a_small_vocabulary_is_refused_by_field():
    async def main():
        backend = FakeBackend(vocab_size=12, max_model_len=4096)
        async with running_app(create_app(Settings(**LIMITS), backend)) as client:
            rows_before = len(backend.rows)
            _check_error(await _post(client, good(top_k=13)), 422, "invalid_value", "top_k")
            assert len(backend.rows) == rows_before, "a bad request reached the backend"
            assert (await _post(client, good(top_k=12))).status_code == 200

    asyncio.run(main())


BAD_RAW = [
    ("garbage-json", b"{not json", JSON_H, 400, "malformed_body", None),
    ("truncated-json", b'{"sequences": [{"input_ids": [1, 2', JSON_H, 400, "malformed_body", None),
    ("garbage-msgpack", b"\xc1\xc1\xc1", MSGPACK_H, 400, "malformed_body", None),
    ("truncated-msgpack", msgpack.packb(good())[:-3], MSGPACK_H, 400, "malformed_body", None),
    ("msgpack-int-keys", msgpack.packb({1: 2}), MSGPACK_H, 400, "malformed_body", None),
    # bin keys: a field under one would be reported missing (input_ids) or named b'...' (extra)
    ("msgpack-bin-key", msgpack.packb({b"sequences": [{"input_ids": [1, 2]}]}), MSGPACK_H, 400, "malformed_body",
     None),
    ("msgpack-bin-key-in-sequence", msgpack.packb({"sequences": [{b"input_ids": [1, 2]}]}), MSGPACK_H, 400,
     "malformed_body", None),
    ("msgpack-bin-extra-key", msgpack.packb({"sequences": [{"input_ids": [1, 2]}], b"foo": 1}), MSGPACK_H, 400,
     "malformed_body", None),
    ("text-plain", json.dumps(good()).encode(), {"Content-Type": "text/plain"}, 400, "unsupported_content_type",
     "Content-Type"),
    ("form", b"a=b", {"Content-Type": "application/x-www-form-urlencoded"}, 400, "unsupported_content_type",
     "Content-Type"),
    ("gzip", gzip.compress(json.dumps(good()).encode()), {**JSON_H, "Content-Encoding": "gzip"}, 400,
     "unsupported_content_encoding", "Content-Encoding"),
    ("too-big", json.dumps({"sequences": [{"input_ids": [1] * 10_000}]}).encode(), JSON_H, 413, "body_too_large",
     None),
    ("msgpack-bin-odd-length", msgpack.packb({"sequences": [{"input_ids": b"\x01\x00\x00"}]}), MSGPACK_H, 422,
     "invalid_value", "sequences[0].input_ids"),
    ("msgpack-bin-out-of-vocab",
     msgpack.packb({"sequences": [{"input_ids": np.array([1, 5000], "<i4").tobytes()}]}), MSGPACK_H, 422,
     "invalid_value", "sequences[0].input_ids[1]"),
    ("msgpack-bin-negative", msgpack.packb({"sequences": [{"input_ids": np.array([-3], "<i4").tobytes()}]}),
     MSGPACK_H, 422, "invalid_value", "sequences[0].input_ids[0]"),
    ("msgpack-bin-empty", msgpack.packb({"sequences": [{"input_ids": b""}]}), MSGPACK_H, 422, "invalid_value",
     "sequences[0].input_ids"),
    ("msgpack-nan-temperature", msgpack.packb(good(temperature=float("nan"))), MSGPACK_H, 422, "invalid_value",
     "temperature"),
    ("msgpack-float-id", msgpack.packb(seq(input_ids=[1, 2.0])), MSGPACK_H, 422, "invalid_value",
     "sequences[0].input_ids[1]"),
    # An extension value is one value of the field that holds it, not a (code, data) pair.
    ("msgpack-ext-ids", msgpack.packb({"sequences": [{"input_ids": msgpack.ExtType(5, b"12345678")}]}), MSGPACK_H,
     422, "invalid_value", "sequences[0].input_ids"),
    ("msgpack-ext-sequences", msgpack.packb({"sequences": msgpack.ExtType(1, b"ab")}), MSGPACK_H, 422,
     "invalid_value", "sequences"),
    ("msgpack-ext-in-ids", msgpack.packb({"sequences": [{"input_ids": [1, msgpack.ExtType(5, b"1")]}]}), MSGPACK_H,
     422, "invalid_value", "sequences[0].input_ids[1]"),
]


def test_malformed_bodies_get_400_413_422_with_the_contract_body():
    async def main():
        app, backend = make_app()
        async with running_app(app) as client:
            rows_before = len(backend.rows)
            await _each_refused(client, BAD_RAW)
            response = await client.post("/score", content=json.dumps(good()).encode())  # no Content-Type
            _check_error(response, 400, "unsupported_content_type", "Content-Type")
            assert len(backend.rows) == rows_before

    asyncio.run(main())


def test_a_bin_map_key_is_named_and_an_object_expected_is_called_one():
    async def main():
        app, _ = make_app()
        async with running_app(app) as client:
            bin_key = await client.post("/score", content=msgpack.packb({"sequences": [{b"input_ids": [1, 2]}]}),
                                        headers=MSGPACK_H)
            not_object = await _post(client, {"sequences": [[1, 2]]})
            return bin_key, not_object

    bin_key, not_object = asyncio.run(main())
    assert "bin key, 'input_ids'" in bin_key.json()["error"]["message"], bin_key.text
    _check_error(not_object, 422, "invalid_value", "sequences[0]")
    message = not_object.json()["error"]["message"]
    assert "an object" in message and "SequenceIn" not in message, message


def test_a_one_byte_value_is_called_one_byte():
    async def main():
        app, _ = make_app()
        async with running_app(app) as client:
            ext = await client.post("/score", headers=MSGPACK_H, content=msgpack.packb(
                {"sequences": [{"input_ids": [1, msgpack.ExtType(5, b"1")]}]}))
            bin_id = await client.post("/score", headers=MSGPACK_H, content=msgpack.packb(
                {"sequences": [{"id": b"x", "input_ids": [1, 2]}]}))
            return ext, bin_id

    for answer, param in zip(asyncio.run(main()), ["sequences[0].input_ids[1]", "sequences[0].id"]):
        _check_error(answer, 422, "invalid_value", param)
        message = answer.json()["error"]["message"]
        assert "1 byte" in message and "1 bytes" not in message, message


def test_a_json_body_that_is_not_utf8_is_named_as_one():
    """orjson's words for any byte that is not UTF-8 were "surrogates not allowed: line 1 column 1 (char 0)",
    wherever the byte was: a msgpack body sent as JSON, or a Latin-1 id."""
    latin1_id = b'{"sequences": [{"id": "caf\xe9", "input_ids": [1, 2]}]}'

    async def main():
        app, _ = make_app()
        async with running_app(app) as client:
            return [await _post(client, body) for body in (latin1_id, msgpack.packb(good()))]

    for answer, byte in zip(asyncio.run(main()), (latin1_id.index(b"\xe9") + 1, 1)):
        _check_error(answer, 400, "malformed_body", None)
        message = answer.json()["error"]["message"]
        assert f"not UTF-8 at byte {byte} " in message and "surrogates" not in message, message
        assert "Content-Type: application/msgpack" in message, message


def test_an_empty_key_is_named_as_one():
    async def main():
        app, _ = make_app()
        async with running_app(app) as client:
            return await _post(client, good(**{"": 1})), await _post(client, seq(**{"": 1}))

    top, nested = asyncio.run(main())
    assert top.json()["error"]["message"] == "An empty key is not a field of this request.", top.text
    _check_error(nested, 422, "invalid_value", "sequences[0]")
    assert nested.json()["error"]["message"] == "An empty key is not a field of sequences[0].", nested.text


def test_a_long_unknown_key_is_not_echoed_whole():
    async def main():
        app, _ = make_app()
        async with running_app(app) as client:
            return await _post(client, good(**{"k" * 10_000: 1})), await _post(client, seq(**{"k" * 61: 1}))

    for answer, holder in zip(asyncio.run(main()), [None, "sequences[0]"]):
        _check_error(answer, 422, "invalid_value", holder)
        assert len(answer.text) < 400 and "characters) is not a field of" in answer.text, answer.text[:400]


def test_an_unknown_key_holding_a_line_break_or_control_character_is_shown_escaped():
    """Such a key was the param and the message as sent: its line break split the message, and the log line
    of a refused weights update that quotes it, in two (a forged line)."""
    forged = "x\n2026-01-01 00:00:00,000 ERROR service.runtime: forged"

    async def main():
        app, _ = make_app()
        async with running_app(app) as client:
            return [await _post(client, body) for body in (good(**{forged: 1}), seq(**{"a\x00\u2028b": 1}))]

    for answer, holder, shown in zip(asyncio.run(main()), [None, "sequences[0]"], [repr(forged), "'a\\x00\\u2028b'"]):
        _check_error(answer, 422, "invalid_value", holder)
        message = answer.json()["error"]["message"]
        assert message.isprintable() and shown in message and "characters) is not a field of" in message, message


def test_a_long_model_name_or_version_is_not_echoed_whole():
    async def main():
        app, _ = make_app()
        async with running_app(app) as client:
            return await _post(client, good(model="m" * 10_000)), await _post(client, good(weights_version="v" * 10_000))

    unknown, mismatch = asyncio.run(main())
    _check_error(unknown, 404, "model_not_found", "model")
    _check_error(mismatch, 409, "weights_version_mismatch", "weights_version")
    for response in (unknown, mismatch):
        assert len(response.json()["error"]["message"]) < 200, response.text[:300]


def _decode_bins(result, k):
    out = {"id": result["id"], "logprobs": np.frombuffer(result["logprobs"], "<f4")}
    if "entropy" in result:
        out["entropy"] = np.frombuffer(result["entropy"], "<f4")
    if "top_k_ids" in result:
        out["top_k_ids"] = np.frombuffer(result["top_k_ids"], "<i4").reshape(-1, k)
        out["top_k_logprobs"] = np.frombuffer(result["top_k_logprobs"], "<f4").reshape(-1, k)
    return out


@pytest.mark.parametrize("top_k", [0, 3], ids=["topk0", "topk3"])
@pytest.mark.parametrize("return_entropy", [True, False], ids=["entropy", "no-entropy"])
def test_json_and_msgpack_answers_hold_the_same_numbers(top_k, return_entropy):
    seqs = [
        {"id": "a", "input_ids": [5, 6, 7, 8, 9], "score_from": 2},
        {"id": None, "input_ids": [11], "score_from": 1},  # score_from == L: empty arrays
        {"input_ids": list(range(30, 60)), "score_from": 25},
    ]
    options = dict(temperature=0.7, top_k=top_k, return_entropy=return_entropy)

    async def main():
        app, _ = make_app()
        async with running_app(app) as client:
            as_json = await client.post("/score", json={"sequences": seqs, **options})
            packed = {"sequences": [{**s, "input_ids": np.array(s["input_ids"], "<i4").tobytes()} for s in seqs],
                      **options}
            as_msgpack = await client.post("/score", content=msgpack.packb(packed), headers=MSGPACK_H)
            return as_json, as_msgpack

    as_json, as_msgpack = asyncio.run(main())
    assert as_json.status_code == 200 and as_json.headers["content-type"] == "application/json"
    assert as_msgpack.status_code == 200 and as_msgpack.headers["content-type"] == "application/msgpack"
    body_json = as_json.json()
    ScoreResponse.model_validate(body_json)
    body_mp = msgpack.unpackb(as_msgpack.content, raw=False)
    for body in (body_json, body_mp):
        assert body["model"] == "fake-model" and body["weights_version"] == "fake#1"
        assert body["usage"] == {"input_tokens": 36, "scored_tokens": 3 + 0 + 5}
        assert [r["id"] for r in body["results"]] == ["a", None, None]
    for s, rj, rm in zip(seqs, body_json["results"], body_mp["results"]):
        want = expected_scores(SequenceInput(np.array(s["input_ids"]), s["score_from"], 0.7, top_k, return_entropy))
        got_mp = _decode_bins(rm, top_k)
        assert ("entropy" in rj) == ("entropy" in rm) == return_entropy
        assert ("top_k_ids" in rj) == ("top_k_ids" in rm) == (top_k > 0)
        np.testing.assert_array_equal(np.asarray(rj["logprobs"], np.float32), want.logprobs)
        np.testing.assert_array_equal(got_mp["logprobs"], want.logprobs)
        if return_entropy:
            np.testing.assert_array_equal(np.asarray(rj["entropy"], np.float32), want.entropy)
            np.testing.assert_array_equal(got_mp["entropy"], want.entropy)
        if top_k:
            np.testing.assert_array_equal(np.asarray(rj["top_k_ids"]).reshape(-1, top_k), want.top_k_ids)
            np.testing.assert_array_equal(got_mp["top_k_ids"], want.top_k_ids)
            np.testing.assert_array_equal(np.asarray(rj["top_k_logprobs"], np.float32).reshape(-1, top_k),
                                          want.top_k_logprobs)
            np.testing.assert_array_equal(got_mp["top_k_logprobs"], want.top_k_logprobs)


def test_accept_picks_the_answer_encoding_and_errors_stay_json():
    async def main():
        app, _ = make_app()
        async with running_app(app) as client:
            r1 = await client.post("/score", json=good(), headers={"Accept": "application/msgpack"})
            r2 = await client.post("/v1/score", content=msgpack.packb(good()),
                                   headers={**MSGPACK_H, "Accept": "application/json"})
            r3 = await client.post("/score", content=msgpack.packb(good()), headers={**MSGPACK_H, "Accept": "*/*"})
            r4 = await client.post("/score", content=msgpack.packb(good(top_k=99)),
                                   headers={**MSGPACK_H, "Accept": "application/msgpack"})
            return r1, r2, r3, r4

    r1, r2, r3, r4 = asyncio.run(main())
    assert r1.headers["content-type"] == "application/msgpack"
    assert msgpack.unpackb(r1.content)["results"][0]["id"] == "a"
    assert r2.headers["content-type"] == "application/json" and r2.json()["results"][0]["id"] == "a"
    assert r3.headers["content-type"] == "application/msgpack"
    _check_error(r4, 422, "invalid_value", "top_k")


@pytest.mark.parametrize(
    "accept, expected",
    [
        (None, "json"),
        ("", "json"),
        ("*/*", "json"),
        ("application/msgpack", "msgpack"),
        ("application/x-msgpack", "msgpack"),
        ("application/json;q=0.5, application/msgpack", "msgpack"),
        ("application/msgpack;q=0.1, application/json;q=0.9", "json"),
        ("application/msgpack;q=0", "json"),
        ("text/html", "json"),
    ],
)
def test_accept_negotiation(accept, expected):
    assert response_encoding(accept, "json") == expected


@pytest.mark.parametrize(
    "accept, default, expected",
    [
        ("application/msgpack;q=0", "msgpack", "json"),  # the request's encoding refused: the other one
        ("application/x-msgpack; q=0.0", "msgpack", "json"),
        ("application/json;q=0, */*", "json", "msgpack"),
        ("application/json;q=0, application/msgpack;q=0", "json", "json"),  # both refused: no 406 in the contract
        ("application/json;q=0", "msgpack", "msgpack"),
        ("*/*", "msgpack", "msgpack"),
    ],
)
def test_accept_that_refuses_the_request_encoding_gets_the_other(accept, default, expected):
    assert response_encoding(accept, default) == expected


@pytest.mark.parametrize(
    "accept, default, expected",
    [
        # each encoding takes the q of the most specific range matching it (RFC 9110 section 12.5.1)
        ("application/json;q=0.5, */*;q=0.9", "json", "msgpack"),
        ("application/json;q=0.5, */*;q=0.9", "msgpack", "msgpack"),
        ("application/msgpack;q=0.5, */*", "json", "json"),
        ("application/msgpack;q=0.5, */*", "msgpack", "json"),
        ("application/*;q=0.5, application/json;q=0.1", "json", "msgpack"),
        ("application/*;q=0.1, */*;q=0.9", "msgpack", "msgpack"),  # application/* ranks both: the request's
        # equal q: the one named by its own type, then the first named
        ("application/msgpack, */*", "json", "msgpack"),
        ("application/json, application/msgpack", "msgpack", "json"),
        ("application/x-msgpack;q=0.2, application/msgpack;q=0.8, application/json;q=0.5", "json", "msgpack"),
    ],
)
def test_accept_wildcards_rank_below_the_types_they_cover(accept, default, expected):
    assert response_encoding(accept, default) == expected


def test_an_accept_preferring_anything_to_json_gets_msgpack_over_http():
    async def main():
        app, _ = make_app()
        async with running_app(app) as client:
            return await client.post("/score", json=good(), headers={"Accept": "application/json;q=0.5, */*;q=0.9"})

    response = asyncio.run(main())
    assert response.status_code == 200 and response.headers["content-type"] == "application/msgpack", response.headers
    assert msgpack.unpackb(response.content)["results"][0]["id"] == "a"


def test_several_accept_lines_are_read_as_one_list():
    async def main():
        app, _ = make_app()
        async with running_app(app) as client:
            return await client.post("/score", content=json.dumps(good()).encode(),
                                     headers=[("Content-Type", "application/json"), ("Accept", "text/html"),
                                              ("Accept", "application/msgpack")])

    response = asyncio.run(main())
    assert response.status_code == 200 and response.headers["content-type"] == "application/msgpack", response.headers


def test_param_path_uses_the_contract_notation():
    assert param_path(("body", "sequences", 3, "input_ids", 17)) == "sequences[3].input_ids[17]"
    assert param_path(("query", "limit")) == "limit"
    assert param_path(()) is None
    assert SCHEMA_MAX_TOP_K == MAX_TOP_K == 20


def test_fastapi_request_validation_errors_use_the_contract_body():
    """A route that lets FastAPI validate (here a query parameter) still answers the contract's 422."""

    async def main():
        app, _ = make_app()

        @app.get("/probe-validation")
        async def probe(limit: int):
            return {"limit": limit}

        async with running_app(app) as client:
            return await client.get("/probe-validation", params={"limit": "many"})

    response = asyncio.run(main())
    _check_error(response, 422, "invalid_value", "limit")


# Integer literals past 64 bits: orjson reads them as floats (or refuses them as "infinity"), so
# the message must come from the field, never show the float ("1e+40") or a parser's complaint.
BIG_INTEGERS = [
    ("deadline-10e40", b'{"sequences": [{"input_ids": [1, 2]}], "deadline_ms": 1' + b"0" * 40 + b"}", "deadline_ms"),
    ("id-5000-digits", b'{"sequences": [{"id": ' + b"7" * 5000 + b', "input_ids": [1, 2]}]}', "sequences[0].id"),
    ("input-id-30-digits", b'{"sequences": [{"input_ids": [1, ' + b"9" * 30 + b"]}]}", "sequences[0].input_ids[1]"),
    ("input-id-5000-digits", b'{"sequences": [{"input_ids": [1, ' + b"9" * 5000 + b"]}]}", "sequences[0].input_ids[1]"),
    ("top-k-25-digits-with-nan", b'{"sequences": [{"input_ids": [1]}], "top_k": ' + b"1" * 25 + b', "x": NaN}', "top_k"),
    ("score-from-negative-25-digits", b'{"sequences": [{"input_ids": [1], "score_from": -' + b"1" * 25 + b"}]}",
     "sequences[0].score_from"),
]  # fmt: skip


@pytest.mark.parametrize("name, raw, param", BIG_INTEGERS, ids=[c[0] for c in BIG_INTEGERS])
def test_integers_past_64_bits_are_refused_by_field(name, raw, param):
    async def main():
        app, backend = make_app()
        async with running_app(app) as client:
            rows_before = len(backend.rows)
            response = await client.post("/score", content=raw, headers=JSON_H)
            _check_error(response, 422, "invalid_value", param)
            message = response.json()["error"]["message"]
            assert message.startswith(param) and "64 bits" in message, message
            for leak in ("e+", "inf", "1111111111", "7777777777", "9999999999", "0000000000"):
                assert leak not in message, f"{name}: {message!r} shows {leak!r}"
            assert len(backend.rows) == rows_before

    asyncio.run(main())


def test_a_64_bit_deadline_is_still_an_integer():
    async def main():
        app, _ = make_app()
        async with running_app(app) as client:
            raw = b'{"sequences": [{"input_ids": [1, 2]}], "deadline_ms": 18446744073709551615}'
            assert (await client.post("/score", content=raw, headers=JSON_H)).status_code == 200

    asyncio.run(main())


@pytest.mark.parametrize("depth", [950, 990, 1100, 5000])
def test_a_deeply_nested_value_is_a_4xx_naming_its_field(depth):
    """A value nested deeper than Python's own stack where a string is expected: never a 500."""
    import msgpack

    nested = "[" * depth + "1" + "]" * depth

    async def main():
        app, backend = make_app()
        async with running_app(app) as client:
            as_json = await client.post("/score", content=f'{{"sequences":[{{"input_ids":[1,2]}}],"model":{nested}}}',
                                        headers=JSON_H)
            # written by hand: msgpack's own packer stops at 512 levels (0x91: an array of one)
            body = msgpack.packb({"sequences": [{"input_ids": [1, 2], "id": 0}]})
            body = body[:-1] + b"\x91" * min(depth, 2000) + b"\x01"
            as_msgpack = await client.post("/score", content=body, headers=MSGPACK_H)
            return as_json, as_msgpack

    as_json, as_msgpack = asyncio.run(main())
    assert as_json.status_code in (400, 422), as_json.text
    assert as_json.json()["error"]["param"] in ("model", None), as_json.text
    if depth < 1023:  # deeper, the msgpack decoder refuses the body itself: 400
        _check_error(as_msgpack, 422, "invalid_value", "sequences[0].id")
    else:
        assert as_msgpack.status_code == 400, as_msgpack.text


def test_a_score_from_past_the_end_is_named_whole_in_the_message():
    """A trainer's log often keeps only the message: it names the sequence, not just the field."""

    async def main():
        app, _ = make_app()
        async with running_app(app) as client:
            return await _post(client, {"sequences": [{"input_ids": [1, 2]}, {"input_ids": [1, 2, 3], "score_from": 4}]})

    body = asyncio.run(main()).json()["error"]
    assert body["param"] == "sequences[1].score_from" and body["message"].startswith("sequences[1].score_from "), body


def test_a_path_holding_unprintable_characters_is_shown_escaped():
    async def main():
        app, _ = make_app()
        async with running_app(app) as client:
            return await client.get("/v1/mod%00els%E2%80%AEforged")  # a NUL, a right-to-left override

    answer = asyncio.run(main())
    _check_error(answer, 404, "not_found", None)
    message = answer.json()["error"]["message"]
    assert message == "No route /v1/mod\\x00els\\u202eforged.", message
