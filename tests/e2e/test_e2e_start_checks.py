"""What the real CLI refuses at start, before the port is bound, and what it leaves alone: each
command reads the variables of its own options only."""

from __future__ import annotations

import json
import sys

from model_runtime.pool.ports import free_port
from tests.e2e.helpers import ServerProcess, post, run_watching_port

# Values each option's own command refuses (exit 2), set for the other command.
SERVE_ONLY = {"PACKSCORE_PORT": "abc", "PACKSCORE_HOST": "", "PACKSCORE_MAX_QUEUED_TOKENS": "0",
              "PACKSCORE_API_KEY": "k", "PACKSCORE_API_KEY_FILE": "/nonexistent/key"}
SCORE_ONLY = {"PACKSCORE_TOP_K": "99", "PACKSCORE_TEMPERATURE": "0", "PACKSCORE_RETURN_ENTROPY": "maybe"}


def test_score_reads_no_variable_of_an_option_only_serve_has(tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(json.dumps({"id": "a", "input_ids": [1, 2, 3, 4]}) + "\n")
    command = [sys.executable, "-m", "service.cli", "score", str(source), "-o", str(out), "--log-level", "warning"]
    code, output, _ = run_watching_port(command, None, env=SERVE_ONLY)
    assert code == 0, f"exit status {code}, expected 0:\n{output}"
    assert "PACKSCORE_" not in output, f"a serve-only variable was read or reported:\n{output}"
    line = json.loads(out.read_text().splitlines()[0])
    assert line["id"] == "a" and len(line["logprobs"]) == 3, line
    # its own options' variables are still read and checked
    code, output, _ = run_watching_port(command, None, env={"PACKSCORE_TOP_K": "99"})
    assert code == 2 and "--top-k (from PACKSCORE_TOP_K): " in output, output


def test_serve_reads_no_variable_of_an_option_only_score_has(tmp_path):
    server = ServerProcess(tmp_path, "--log-level", "warning", api_key=None, env=SCORE_ONLY)
    try:
        server.wait_ready()
        response = post(server.url, {"sequences": [{"input_ids": [1, 2, 3, 4]}]}, headers={})
        assert response.status_code == 200, response.text
        assert "entropy" in response.json()["results"][0]  # return_entropy is the request's, default true
    finally:
        assert server.stop() == 0, server.log()
    assert "PACKSCORE_" not in server.log(), server.log()
    port = free_port()
    command = [sys.executable, "-m", "service.cli", "serve", "--port", str(port)]
    code, output, connected = run_watching_port(command, port, env={"PACKSCORE_MAX_QUEUED_TOKENS": "0"})
    assert code == 2 and not connected and "--max-queued-tokens (from PACKSCORE_MAX_QUEUED_TOKENS): " in output, output
