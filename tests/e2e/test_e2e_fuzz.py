"""Property-based fuzzing of the served OpenAPI schema with schemathesis (4.x API).

Several hundred generated requests, valid and invalid, in JSON and msgpack, against the real tiny
server: no 5xx, and every answer matches the schema (status code documented, content type,
body, headers).
"""

from __future__ import annotations

import msgpack
import schemathesis
from hypothesis import HealthCheck, given, reject, settings
from schemathesis import GenerationMode
from schemathesis.checks import load_all_checks
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tests.e2e.helpers import AUTH

POSITIVE_EXAMPLES = 150
NEGATIVE_EXAMPLES = 100


@schemathesis.serializer("application/msgpack")
def _to_msgpack(ctx, value):
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (OverflowError, TypeError, ValueError):
        reject()  # not expressible in msgpack at all (an integer beyond 64 bits): nothing to send


@schemathesis.deserializer("application/msgpack")
def _from_msgpack(ctx, response):
    # The schema documents raw arrays as binary strings; validate them as strings (hex text).
    def text(value):
        if isinstance(value, bytes):
            return value.hex()
        if isinstance(value, dict):
            return {k: text(v) for k, v in value.items()}
        if isinstance(value, list):
            return [text(v) for v in value]
        return value

    return text(msgpack.unpackb(response.content, raw=False))


def _no_server_error_but_deadlines(ctx, response, case):
    """No 5xx, except the contract's 504 for a request that set deadline_ms (the fuzzer sends 1 ms)."""
    if response.status_code >= 500:
        body = case.body if isinstance(case.body, dict) else {}
        assert response.status_code == 504 and body.get("deadline_ms") is not None, (
            f"server error {response.status_code}: {response.text[:300]}"
        )


def _fuzz(url: str, mode: GenerationMode, max_examples: int) -> int:
    load_all_checks()
    schema = schemathesis.openapi.from_url(url + "/openapi.json", headers=AUTH)
    schema.config.update(base_url=url)
    # Schema-violating bodies must be refused; the contract answers "too many / too large" with 413.
    rejection = schema.config.checks.negative_data_rejection
    rejection.expected_statuses = [*rejection.expected_statuses, "413"]
    sent = []

    @given(case=schema.as_strategy(generation_mode=mode))
    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def run(case):
        # positive_data_acceptance would demand 2xx for every schema-valid body, but JSON Schema
        # cannot say "score_from <= len(input_ids)" or bound a request's total tokens: those
        # well-formed bodies are rightly answered 422 / 413 / 429.
        case.call_and_validate(
            headers=AUTH,
            timeout=60,
            excluded_checks=[positive_data_acceptance, not_a_server_error],
            additional_checks=[_no_server_error_but_deadlines],
        )
        sent.append(case)

    run()
    return len(sent)


def test_fuzz_the_openapi_schema_no_5xx_and_answers_match_it(tiny_server):
    positive = _fuzz(tiny_server.url, GenerationMode.POSITIVE, POSITIVE_EXAMPLES)
    negative = _fuzz(tiny_server.url, GenerationMode.NEGATIVE, NEGATIVE_EXAMPLES)
    assert positive + negative >= 200, (positive, negative)
