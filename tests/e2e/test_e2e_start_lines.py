"""What an operator reads in the log while ``packscore serve`` starts a real checkpoint: a line when
its load begins (its files, their size, the dtype and device) and one when its warm-up begins, each
before the line that says it ended; a start this short has no "still loading" line. ``packscore
score`` loads through the same code and says the same load line; with ``--fsdp`` each rank says when
its shard read begins and ends, after its "loaded" line (the model built empty) and before the pool is up."""

from __future__ import annotations

import json
import re
import sys

from tests.checkpoints import save_checkpoint
from tests.e2e.helpers import ServerProcess, run_watching_port

_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO ([\w.]+): (.*)")


def _sharded(tmp_path):
    path = save_checkpoint("qwen3_5", tmp_path / "ck", max_shard_size="200KB")
    files = sorted(path.glob("*.safetensors"))
    assert len(files) > 1, files  # an index and its shards, as a real checkpoint ships
    size = sum(f.stat().st_size for f in files) / 2**30
    return path, f"loading ck from {path}: {len(files)} safetensors files, {size:.1f} GiB, as float32 on cpu"


def _info(text: str) -> list[tuple[str, str]]:
    return [m.groups() for line in text.splitlines() if (m := _LINE.fullmatch(line))]


def test_serve_says_when_the_load_and_the_warm_up_begin(tmp_path):
    path, load_line = _sharded(tmp_path)
    server = ServerProcess(tmp_path, "--model", str(path), "--device", "cpu", api_key=None)
    try:
        server.wait_ready()
    finally:
        assert server.stop() == 0, server.log()
    lines = _info(server.log_path.read_text())
    said = [text for _, text in lines]

    def where(logger: str, start: str) -> int:
        found = [i for i, (name, text) in enumerate(lines) if name == logger and text.startswith(start)]
        assert len(found) == 1, (start, said)
        return found[0]

    begins = where("model_runtime.scoring.loading", load_line)
    assert said[begins] == load_line, said
    loaded = where("model_runtime.scoring.loading", "loaded ck ")
    warming = where("service.runtime", "warming up ck: ")
    assert said[warming] == "warming up ck: one short scoring pass (nothing to compile)", said
    warmed = where("service.runtime", "warm-up of ck took ")
    assert begins < loaded < warming < warmed < where("service.runtime", "ready: serving "), said
    assert not [text for text in said if text.startswith("still ")], said  # seconds, far under the interval


def test_score_says_when_the_load_begins(tmp_path):
    path, load_line = _sharded(tmp_path)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(json.dumps({"id": "a", "input_ids": [1, 2, 3, 4]}) + "\n")
    command = [sys.executable, "-m", "service.cli", "score", str(source), "-o", str(out), "--model", str(path),
               "--device", "cpu"]
    code, output, _ = run_watching_port(command, None)
    assert code == 0, output
    said = [text for name, text in _info(output) if name == "model_runtime.scoring.loading"]
    assert said.count(load_line) == 1, output
    assert said.index(load_line) < next(i for i, text in enumerate(said) if text.startswith("loaded ck ")), said
    assert not [text for _, text in _info(output) if text.startswith("still ")], output  # seconds: no line, none after


def test_score_with_fsdp_says_when_each_rank_reads_its_shards(tmp_path):
    path, _ = _sharded(tmp_path)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(json.dumps({"id": "a", "input_ids": [1, 2, 3, 4]}) + "\n")
    command = [sys.executable, "-m", "service.cli", "score", str(source), "-o", str(out), "--model", str(path),
               "--device", "cpu", "--world-size", "2", "--fsdp"]
    code, output, _ = run_watching_port(command, None)
    assert code == 0, output
    lines = _info(output)

    def where(logger: str, start: str) -> int:
        found = [i for i, (name, text) in enumerate(lines) if name == logger and text.startswith(start)]
        assert len(found) == 1, (start, output)
        return found[0]

    up = where("model_runtime.pool.supervisor", "worker pool generation 1 up: ")
    for rank in (0, 1):
        loaded = where("model_runtime.scoring.loading", f"rank={rank} loaded ck ")
        reading = where("packscore.worker", f"rank={rank} reading its shards of ck from {path}: ")
        assert lines[reading][1].endswith(" GiB, as float32 on cpu"), output
        read = where("packscore.worker", f"rank={rank} read its shards of ck in ")
        assert loaded < reading < read < up, output
    assert not [text for _, text in lines if "still " in text], output

