"""A trainer pushes new weights every few steps for hours (API.md "POST /v1/weights"): a real
server's open files, threads and memory must not grow with the number of updates it has served,
and no update leaves a file behind under the weights root."""

import os
from pathlib import Path

import httpx

from tests.checkpoints import save_checkpoint
from tests.e2e.helpers import AUTH, ServerProcess

UPDATES = 30
WARM_UP = 6


def _usage(pid: int) -> tuple[int, int, int]:
    """Open descriptors, threads and resident bytes of ``pid``, read from /proc."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return len(os.listdir(f"/proc/{pid}/fd")), int(status["Threads"]), int(status["VmRSS"].split()[0]) * 1024


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_repeated_updates_leave_descriptors_threads_memory_and_the_root_as_they_were(tmp_path):
    root = tmp_path / "root"
    for seed in (0, 1):
        save_checkpoint("qwen3_5", root / f"step-{seed}", seed=seed)
    checkpoint_bytes = (root / "step-0" / "model.safetensors").stat().st_size
    files = _files(root)
    server = ServerProcess(tmp_path, "--model", f"policy={root / 'step-0'}", "--weights-root", str(root),
                           "--max-wait-ms", "2")
    try:
        server.wait_ready(timeout=240)
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=120, trust_env=False) as client:

            def update(i: int) -> None:  # alternating directories, each update a version of its own
                answer = client.post("/v1/weights", json={"model": "policy", "path": f"step-{i % 2}", "version": f"v{i}"})
                assert answer.status_code == 200, answer.text
                scored = client.post("/score", json={"sequences": [{"input_ids": [1, 2, 3, 4, 5]}]})
                assert scored.status_code == 200 and scored.json()["weights_version"] == f"v{i}", scored.text

            for i in range(1, WARM_UP + 1):
                update(i)
            fds, threads, rss = _usage(server.proc.pid)
            for i in range(WARM_UP + 1, WARM_UP + UPDATES + 1):
                update(i)
            fds_after, threads_after, rss_after = _usage(server.proc.pid)
    finally:
        assert server.stop() == 0, server.log()
    figures = (f"after {UPDATES} updates (past {WARM_UP} of warm-up): descriptors {fds} -> {fds_after}, "
               f"threads {threads} -> {threads_after}, RSS {rss >> 20} -> {rss_after >> 20} MiB "
               f"(one checkpoint: {checkpoint_bytes >> 10} KiB)")
    print(figures)
    # One descriptor or thread per update would add UPDATES; two covers a connection or worker thread the
    # server opens lazily.
    assert fds_after <= fds + 2, figures
    assert threads_after <= threads + 2, figures
    # Old weights kept per update would add UPDATES checkpoints; allocator settling stays well under half.
    assert rss_after - rss <= UPDATES // 2 * checkpoint_bytes, figures
    assert _files(root) == files, "an update left files under the weights root"
