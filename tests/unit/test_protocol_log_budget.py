"""The protocol's own answers (400, 408, 503) log at WARNING up to a budget a window, then at DEBUG,
then one WARNING counts those (service/http/protocol.py); the real server's flood is in
tests/e2e/test_e2e_logs.py, this checks the window's end, which that test cannot wait for."""

import asyncio
import logging

from service.http import protocol


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
    assert len(said) == 2 and said[0].startswith("more than 10 answers"), said
    assert said[1].startswith("5 more answers the protocol sent itself (400, 408, 503) in the last 0.2 s"), said


def test_a_refused_header_line_is_logged_by_its_name_whatever_form_h11_quotes_it_in():
    """h11 quotes the refused line as a bytearray or as bytes; any other form is not quoted at all:
    the line's value may be a key."""
    key = "sk-secret-1"
    for quoted in (f"bytearray(b'Authorization: Bearer {key}\\r')", f"b'Authorization: Bearer {key}\\x00'"):
        said = protocol.without_header_value(f"illegal header line: {quoted}")
        assert said == "illegal header line 'Authorization' (its value is not logged)", said
    for refused in (f"illegal header line: Authorization: Bearer {key}", f"illegal header line: bytearray(b'{key}')"):
        said = protocol.without_header_value(refused)
        assert key not in said and said.startswith("illegal header line ("), said
    assert protocol.without_header_value("illegal request line: b'GET /x'") == "illegal request line: b'GET /x'"
