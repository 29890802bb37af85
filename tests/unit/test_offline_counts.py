"""``packscore score``'s lines that count something read right for a count of 1: "1 result whose id is",
not "1 results whose ids are" (the plural read as a typo in the lines an operator acts on)."""

import subprocess
import sys
from pathlib import Path

import orjson

from tests import warm_start

REPO = Path(__file__).resolve().parents[2]


def _score(tmp_path, ids: list[str]) -> str:
    """Runs ``packscore score`` (the tiny preset) over IN holding ``ids``; its standard error."""
    source, out, log = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "score.log"
    source.write_bytes(b"".join(orjson.dumps({"id": i, "input_ids": [1, 2, 3]}) + b"\n" for i in ids))
    with log.open("wb") as err:
        run = warm_start.popen([sys.executable, "-m", "service.cli", "score", str(source), "-o", str(out)], cwd=REPO,
                               stdout=err, stderr=subprocess.STDOUT)
        assert run.wait(timeout=300) == 0, log.read_text()[-3000:]
    return log.read_text()


def test_each_count_of_one_is_said_in_the_singular(tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    first = _score(tmp_path, ["a"])
    assert f"1 sequence in {source}, 0 already scored in {out}" in first, first[-3000:]
    assert "scored 1/1 sequence (" in first and f"wrote 1 result to {out}" in first, first[-3000:]
    # OUT as an earlier packscore wrote "a" (no run fields), twice (two OUTs joined with cat), and a result of an id IN lacks
    recorded = orjson.loads(out.read_bytes())
    old = {k: v for k, v in recorded.items() if k not in ("model", "weights_version", "temperature", "dtype", "input_hash")}
    out.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in (old, old, {**recorded, "id": "gone"})))
    again = _score(tmp_path, ["a", "b"])
    assert f"{out} holds 1 id more than once: its last result is the one checked" in again, again[-3000:]
    assert f"{out} holds 1 result whose id is not in {source} (kept as it is)" in again, again[-3000:]
    assert (f"{out}: 1 result does not record the temperature, weights_version and dtype that made it (an earlier "
            "packscore wrote it): it is kept unchecked, so give the --temperature, --model and --dtype it was scored "
            "with") in again, again[-3000:]
    assert "scored 2/2 sequences (" in again and f"wrote 1 result to {out}" in again, again[-3000:]


def test_a_result_of_an_id_not_in_in_is_not_counted_as_one_the_rerun_must_repeat_options_for(tmp_path):
    """An earlier packscore's result whose id IN lacks is kept as it is and never checked: the warning asking the
    rerun for the temperature, model and dtype it was scored with counts IN's unrecorded results only."""
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    out.write_bytes(orjson.dumps({"id": "gone", "logprobs": [-1.5, -2.5], "entropy": [1.0, 1.0]}) + b"\n")
    said = _score(tmp_path, ["a"])
    assert f"{out} holds 1 result whose id is not in {source} (kept as it is)" in said, said[-3000:]
    assert "does not record the temperature" not in said, said[-3000:]
    assert [orjson.loads(line)["id"] for line in out.read_bytes().splitlines()] == ["gone", "a"]
