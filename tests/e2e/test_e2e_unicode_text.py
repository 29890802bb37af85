"""Text that is not valid Unicode (a JSON string's lone surrogate escape, a msgpack str whose bytes are not
UTF-8), in any string field or key of /score and /v1/weights, gets a real server's 422 naming that field
in plain words, as any invalid value does (docs/api.md: 422 a well-formed body whose values are
invalid); a JSON body whose bytes are not UTF-8 is no JSON at all: 400, as before."""

from __future__ import annotations

import httpx
import msgpack
import pytest

from tests.e2e.helpers import AUTH

_PLAIN = "must be valid Unicode text, without unpaired surrogates"
_SEQUENCES = [{"input_ids": [1, 2]}]


@pytest.fixture(scope="module")
def server(weights_root_server):
    return weights_root_server


def _msgpack_with_bytes(body: dict, marker: str, raw: bytes) -> bytes:
    """``body`` packed, with the str ``marker`` (as long as ``raw``) holding ``raw``'s bytes instead."""
    assert len(marker.encode()) == len(raw) < 32  # a fixstr: its header holds the length, unchanged
    packed = msgpack.packb(body)
    header = bytes([0xA0 | len(raw)])
    assert packed.count(header + marker.encode()) == 1, packed
    return packed.replace(header + marker.encode(), header + raw)


CASES = {  # name: (route, body bytes, content type, param)
    "json-id": ("/score", rb'{"sequences": [{"id": "\ud800", "input_ids": [1, 2]}]}', "json", "sequences[0].id"),
    "json-id-later": ("/score", rb'{"sequences": [{"input_ids": [1]}, {"id": "ok \udfff", "input_ids": [1, 2]}]}',
                      "json", "sequences[1].id"),
    "json-model": ("/score", rb'{"model": "\udc00", "sequences": [{"input_ids": [1, 2]}]}', "json", "model"),
    "json-version": ("/score", rb'{"weights_version": "v\ud83d", "sequences": [{"input_ids": [1, 2]}]}', "json",
                     "weights_version"),
    "json-key": ("/score", rb'{"sequences": [{"\ud800": 1, "input_ids": [1, 2]}]}', "json", "sequences[0]"),
    "json-weights-path": ("/v1/weights", rb'{"path": "step-\ud800"}', "json", "path"),
    "json-weights-version": ("/v1/weights", rb'{"path": "step-1", "version": "\ud800"}', "json", "version"),
    "msgpack-id": ("/score", _msgpack_with_bytes({"sequences": [{"id": "@@", "input_ids": [1, 2]}]}, "@@", b"\xff\xfe"),
                   "msgpack", "sequences[0].id"),
    "msgpack-model": ("/score", _msgpack_with_bytes({"model": "@@@", "sequences": _SEQUENCES}, "@@@", b"\xed\xa0\x80"),
                      "msgpack", "model"),
    "msgpack-key": ("/score", _msgpack_with_bytes({"sequences": _SEQUENCES, "@": 1}, "@", b"\x80"), "msgpack", None),
    "msgpack-weights-path": ("/v1/weights", _msgpack_with_bytes({"path": "@"}, "@", b"\xc3"), "msgpack", "path"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_text_that_is_not_unicode_gets_a_422_naming_its_field_in_plain_words(server, case):
    route, content, encoding, param = CASES[case]
    answer = httpx.post(server.url + route, content=content, timeout=60,
                        headers={**AUTH, "Content-Type": f"application/{encoding}"})
    assert answer.status_code == 422 and answer.headers["content-type"] == "application/json", answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_value" and error["param"] == param, error
    named = (f"{param}: " if param else "the body: ") + ("a key " if "key" in case else "")
    assert error["message"].startswith(named + _PLAIN) and error["message"].endswith("."), error
    assert "codec" not in error["message"] and "unicode string" not in error["message"], error


def test_a_json_body_whose_bytes_are_not_utf8_is_malformed_and_paired_surrogates_are_text(server):
    malformed = httpx.post(server.url + "/score", content=b'{"sequences": [{"id": "\xff", "input_ids": [1, 2]}]}',
                           headers={**AUTH, "Content-Type": "application/json"}, timeout=60)
    assert malformed.status_code == 400 and malformed.json()["error"]["type"] == "malformed_body", malformed.text
    paired = httpx.post(server.url + "/score", content=rb'{"sequences": [{"id": "\ud83d\ude00", "input_ids": [1, 2]}]}',
                        headers={**AUTH, "Content-Type": "application/json"}, timeout=60)
    assert paired.status_code == 200 and paired.json()["results"][0]["id"] == "\U0001F600", paired.text
    packed = msgpack.packb({"sequences": [{"id": "ü\U0001F600", "input_ids": [1, 2]}]})
    echoed = httpx.post(server.url + "/score", content=packed, timeout=60,
                        headers={**AUTH, "Content-Type": "application/msgpack", "Accept": "application/json"})
    assert echoed.status_code == 200 and echoed.json()["results"][0]["id"] == "ü\U0001F600", echoed.text
