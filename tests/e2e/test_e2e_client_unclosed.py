"""A client dropped without ``close()`` / ``aclose()`` closes its connections all the same, against a
real server in a fresh interpreter that shows every ResourceWarning: an unclosed socket or asyncio
transport left to the garbage collector, or to a closed event loop, would be one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import packscore_client
from tests.e2e.helpers import API_KEY

# Each case scores once and lets go of its client; "done" is printed once the collector has run.
CASES = {
    "sync-dropped": """
client = ScoreClient(url, API_KEY)
client.score([[1, 2, 3]])
del client
""",
    "sync-dropped-after-a-split-call": """
client = ScoreClient(url, API_KEY, max_sequences_per_request=1)
client.score([[1, 2, 3]] * 8)  # its pool's connections, several at once
del client
""",
    "async-dropped-in-its-loop": """
async def main():
    client = AsyncScoreClient(url, API_KEY)
    await client.score([[1, 2, 3]])
    del client
    await asyncio.sleep(0.5)  # the loop goes on
asyncio.run(main())
""",
    "async-dropped-as-its-run-ends": """
async def main():
    client = AsyncScoreClient(url, API_KEY)
    await client.score([[1, 2, 3]])
asyncio.run(main())
""",
    "async-kept-across-asyncio-runs": """
client = AsyncScoreClient(url, API_KEY, max_sequences_per_request=1)
for _ in range(3):  # one asyncio.run per call, as a synchronous training loop runs it
    asyncio.run(client.score([[1, 2, 3]] * 4))
del client
""",
}

HEAD = """
import asyncio, gc, sys
from packscore_client import AsyncScoreClient, ScoreClient
url, API_KEY = sys.argv[1], sys.argv[2]
"""


@pytest.mark.parametrize("case", list(CASES))
def test_a_client_dropped_unclosed_leaves_no_socket_to_the_collector(tiny_server, case):
    code = HEAD + CASES[case] + "gc.collect()\nprint('done', flush=True)\n"
    where = str(Path(packscore_client.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [where, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-X", "tracemalloc=8", "-W", "always::ResourceWarning", "-c", code,
                          tiny_server.url, API_KEY], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "done", out.stdout + out.stderr
    assert "ResourceWarning" not in out.stderr, out.stderr
