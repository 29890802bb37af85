"""The protocol's own answers (400, 408, 503) and send timeouts log at WARNING up to one budget a window,
then at DEBUG, then one WARNING counts those (service/http/protocol.py); the real server's floods are in
tests/e2e/test_e2e_logs.py, this checks the window's end, which those tests cannot wait for."""

import asyncio
import logging

from service.http import protocol, wire


def test_the_window_ends_with_one_line_counting_the_quieted_answers(monkeypatch, caplog):
    monkeypatch.setattr(protocol, "_ANSWER_WINDOW_S", 0.2)
    registry = protocol._Registry(read_timeout_s=1.0, max_connections=10, send_timeout_s=1.0,
                                  on_send_timeout=None, on_closed=None)

    async def flood() -> tuple[list[int], int]:
        levels = [registry.answer_level() for _ in range(protocol._ANSWER_WARNINGS + 5)]
        await asyncio.sleep(0.4)
        return levels, registry.answer_level()

    with caplog.at_level(logging.DEBUG, logger="service.http.protocol"):
        levels, after = asyncio.run(flood())
    assert levels == [logging.WARNING] * protocol._ANSWER_WARNINGS + [logging.DEBUG] * 5
    assert after == logging.WARNING  # a new window
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 2 and said[0].startswith("more than 10 of the protocol's own lines"), said
    assert said[1].startswith("5 more of the protocol's own lines in the last 0.2 s were logged at DEBUG only: "
                              "5 of its answers (400, 408, 503)"), said
    assert "and 0 send timeouts" in said[1], said


def test_send_timeouts_share_the_answers_budget_and_are_counted_apart(monkeypatch, caplog):
    """A send timeout's line (a client that reads none of its answer) was a WARNING each: a thousand
    stalled readers, a thousand lines. It now spends the budget the protocol's answers spend."""
    monkeypatch.setattr(protocol, "_ANSWER_WINDOW_S", 0.2)
    registry = protocol._Registry(read_timeout_s=1.0, max_connections=10, send_timeout_s=1.0,
                                  on_send_timeout=None, on_closed=None)

    async def flood() -> list[int]:
        levels = [registry.answer_level() for _ in range(4)]  # answers first: the budget is shared
        levels += [registry.answer_level(send_timeout=True) for _ in range(protocol._ANSWER_WARNINGS + 3)]
        levels.append(registry.answer_level())
        await asyncio.sleep(0.4)
        return levels

    with caplog.at_level(logging.DEBUG, logger="service.http.protocol"):
        levels = asyncio.run(flood())
    assert levels == [logging.WARNING] * protocol._ANSWER_WARNINGS + [logging.DEBUG] * 8, levels
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 2 and "(its answers 400, 408, 503 and its send timeouts)" in said[0], said
    assert said[1].startswith("8 more of the protocol's own lines in the last 0.2 s were logged at DEBUG only: 1 of "
                              "its answers (400, 408, 503), counted by status in packscore_requests_total, and 7 send "
                              "timeouts, counted in packscore_send_timeouts_total"), said


def test_a_refused_header_line_is_logged_by_its_name_whatever_form_h11_quotes_it_in():
    """h11 quotes the refused line as a bytearray or as bytes; any other form is not quoted at all:
    the line's value may be a key."""
    key = "sk-secret-1"
    for quoted in (f"bytearray(b'Authorization: Bearer {key}\\r')", f"b'Authorization: Bearer {key}\\x00'"):
        said = wire.without_header_value(f"illegal header line: {quoted}")
        assert said == "illegal header line 'Authorization' (its value is not logged)", said
    for refused in (f"illegal header line: Authorization: Bearer {key}", f"illegal header line: bytearray(b'{key}')"):
        said = wire.without_header_value(refused)
        assert key not in said and said.startswith("illegal header line ("), said
    assert wire.without_header_value("illegal request line: b'GET /x'") == "illegal request line: b'GET /x'"
