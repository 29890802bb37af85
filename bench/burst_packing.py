"""How the server's scheduler packs a trainer's burst, against offline packing (CPU, seconds).

    python -m bench.burst_packing --out DIR

The RL mix (bench/workload.py, 256 sequences in groups of 8) sent as bench/http_burst.py's client
sends it: 8 requests of 32 sequences at once. The real ``Scheduler`` packs them over a backend
that only records its rows; each row is costed as the tokens its forward runs, every member of a
group sharing its prompt (``RowTokens``; on a GPU the measured kinds of length may cut a group,
on both sides alike). Offline packing is ``Scorer.score``'s (``pack_groups_first_fit``). The
scheduler's rows are also packed with its earlier order, largest first across groups, for
comparison. Writes DIR/burst-packing.json and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from unittest import mock

from bench.workload import WorkloadSpec, grpo_workload
from model_runtime.scoring.prefix import RowTokens, pack_groups_first_fit

PER_REQUEST = 32
MIN_TOKENS = 64
VOCAB = 248_320


def run_tokens(rows) -> int:
    total = 0
    for row in rows:
        run = RowTokens(MIN_TOKENS)
        for seq in row:
            run.add(seq.input_ids)
        total += run.total
    return total


def scheduler_rows(sequences, budget: int) -> list[list]:
    from service.http.metrics import Metrics
    from service.scheduling.scheduler import Scheduler
    from service.testing import FakeBackend

    class Recording(FakeBackend):
        def __init__(self):
            super().__init__(vocab_size=VOCAB, max_model_len=1 << 20)
            self.max_row_tokens = budget
            self.seen: list[list] = []

        def score_row(self, row):
            self.seen.append(list(row))
            return super().score_row(row)

    async def main() -> list[list]:
        backend = Recording()
        scheduler = Scheduler(backend, max_batch_tokens=budget, max_wait_ms=50, max_queued_tokens=1 << 24,
                              metrics=Metrics(), prefix_min_tokens=MIN_TOKENS)
        await scheduler.start()
        tickets = [scheduler.submit(sequences[i : i + PER_REQUEST]) for i in range(0, len(sequences), PER_REQUEST)]
        await asyncio.gather(*(t.future for t in tickets))
        await scheduler.close()
        return backend.seen

    return asyncio.run(main())


def largest_first(window, head):
    return sorted(window, key=lambda it: -it.tokens)


def measure(budgets) -> dict:
    sequences = grpo_workload(VOCAB, WorkloadSpec())
    tokens = sum(s.length for s in sequences)
    out = {"sequences": len(sequences), "tokens": tokens, "per_request": PER_REQUEST, "rows": {}}
    for budget in budgets:
        offline = [[sequences[i] for i in row] for row in pack_groups_first_fit(sequences, budget, MIN_TOKENS)]
        served = scheduler_rows(sequences, budget)
        with mock.patch("service.scheduling.row_queue.largest_first_by_group", largest_first):
            before = scheduler_rows(sequences, budget)
        out["rows"][str(budget)] = {
            name: {"rows": len(rows), "run_tokens": run_tokens(rows), "of_offline": run_tokens(rows) / run_tokens(offline)}
            for name, rows in (("offline", offline), ("scheduler", served), ("scheduler_largest_first", before))}
    return out


def table(result: dict) -> str:
    lines = [f"RL mix, {result['sequences']} sequences, {result['tokens']:,} tokens, sent as requests of "
             f"{result['per_request']}; tokens the rows run, every group member sharing its prompt:", "",
             "| rows of | offline (`Scorer.score`) | scheduler | scheduler, largest first across groups (before) |",
             "| ---: | ---: | ---: | ---: |"]
    for budget, r in result["rows"].items():
        cells = [f"{r[k]['run_tokens']:,} in {r[k]['rows']} rows ({r[k]['of_offline']:.3f})"
                 for k in ("offline", "scheduler", "scheduler_largest_first")]
        lines.append(f"| {int(budget):,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--rows", type=int, nargs="+", default=[16384, 65536])
    args = parser.parse_args(argv)
    result = measure(args.rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "burst-packing.json").write_text(json.dumps(result, indent=1))
    print(table(result))


if __name__ == "__main__":
    main()
