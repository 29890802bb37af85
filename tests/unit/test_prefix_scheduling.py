"""Prefix sharing in the service: row filling, the metric, the flag, and the benchmark's dry run."""

import asyncio
import json
import threading

import numpy as np
import pytest
import torch

from model_runtime.scoring.prefix import RowTokens, tokens_saved
from model_runtime.scoring.rounding import RowRounding
from model_runtime.scoring.rows import plan_row
from model_runtime.types import SequenceInput
from service.cli import build_parser
from service.http.metrics import Metrics
from service.scheduling.scheduler import Scheduler
from service.settings import Settings
from service.testing import FakeBackend


def group(rng, prompt_len, sizes):
    prompt = rng.integers(0, 900, prompt_len)
    return [SequenceInput(np.concatenate([prompt, rng.integers(0, 900, n)]), score_from=prompt_len) for n in sizes]


def made_up_rounding(rng) -> RowRounding:
    """A ``RowRounding`` whose row counts below 600 fall in a dozen ranges of three kinds."""
    starts = sorted({1, *(int(m) for m in rng.integers(70, 600, 12))})
    return RowRounding.from_runs([[m, int(rng.integers(0, 3))] for m in starts], 600)


@pytest.mark.parametrize("with_rounding", [False, True], ids=["by-prompt", "rounding-followed"])
def test_row_tokens_match_the_row_plan_for_random_rows(with_rounding):
    rng = np.random.default_rng(0)
    rounding = made_up_rounding(rng) if with_rounding else None
    for trial in range(200):
        prompts = [rng.integers(0, 4, rng.integers(60, 300)) for _ in range(3)]
        seqs = []
        for _ in range(rng.integers(1, 10)):
            p = prompts[rng.integers(0, 3)]
            ids = np.concatenate([p[: rng.integers(0, p.size + 1)], rng.integers(0, 4, rng.integers(1, 300 if with_rounding else 80))])
            seqs.append(SequenceInput(ids))
        min_tokens = int(rng.choice([1, 64, 100]))
        row = RowTokens(min_tokens, rounding)
        for i, s in enumerate(seqs):
            cost = row.cost_with(s.input_ids)
            before = row.total
            assert not row.add(s.input_ids, budget=cost - 1) and row.total == before  # refused: nothing joined
            assert row.add(s.input_ids, budget=cost)
            want = sum(x.length for x in seqs[: i + 1]) - tokens_saved(seqs[: i + 1], min_tokens, rounding)
            assert cost == row.total == want, f"trial {trial}, sequence {i}: {cost}, {row.total} != {want}"
        assert sum(plan_row(seqs, min_tokens, rounding).lengths) == row.total  # the row runs what was counted


def schedule_once(request, *, max_batch_tokens: int, prefix_min_tokens: int, rounding=None):
    """``(rows, tokens saved)``: one request through a real scheduler over a fake backend that
    records its rows (``rounding``: the backend's measured ``RowRounding``, as a GPU's warm-up sets it)."""

    async def main():
        gate = threading.Event()
        backend = FakeBackend(gate=gate)
        backend.prefix_rounding = rounding
        metrics = Metrics()
        scheduler = Scheduler(backend, max_batch_tokens=max_batch_tokens, max_wait_ms=0, max_queued_tokens=100_000,
                              metrics=metrics, prefix_min_tokens=prefix_min_tokens)
        await scheduler.start()
        ticket = scheduler.submit(request)
        gate.set()
        await ticket.future
        await scheduler.close()
        saved = metrics.registry.get_sample_value("packscore_prefix_tokens_saved_total", {"model": backend.info.name})
        return backend.rows, saved

    return asyncio.run(main())


def test_scheduler_counts_a_shared_prompt_once_and_exports_the_savings():
    rng = np.random.default_rng(1)
    request = group(rng, 300, [100] * 8)  # 3,200 tokens whole, 256 + 8 * 144 = 1,408 shared

    rows, saved = schedule_once(request, max_batch_tokens=1500, prefix_min_tokens=64)
    assert rows == [[400] * 8], rows
    assert saved == 7 * 256, saved
    rows, saved = schedule_once(request, max_batch_tokens=1500, prefix_min_tokens=0)
    assert [len(r) for r in rows] == [3, 3, 2], rows
    assert not saved, saved


def test_scheduler_costs_a_row_as_the_backends_rounding_cuts_the_group():
    rng = np.random.default_rng(2)
    request = group(rng, 300, [100] * 4 + [200] * 4)  # 400- and 500-token members
    # the narrow products take another kernel from 450 rows on: the two lengths do not share
    rounding = RowRounding.from_runs([[1, 0], [450, 1]], 4096)

    # one prompt for all eight: 256 + 4 * 144 + 4 * 244 = 1,808 tokens, one row
    rows, saved = schedule_once(request, max_batch_tokens=2000, prefix_min_tokens=64)
    assert [len(r) for r in rows] == [8] and saved == 7 * 256, (rows, saved)
    # cut in two groups: 832 + 1,232 = 2,064 tokens do not fit 2,000; the first row takes the four
    # 500-token members and three 400-token ones (1,232 + 688 = 1,920), the last goes alone
    rows, saved = schedule_once(request, max_batch_tokens=2000, prefix_min_tokens=64, rounding=rounding)
    assert sorted(sorted(r) for r in rows) == [[400], [400] * 3 + [500] * 4], rows
    assert saved == (3 + 2) * 256, saved


def test_prefix_sharing_is_on_by_default_only_where_it_is_exact_and_the_flags_force_it():
    def settings(*argv):
        args = build_parser().parse_args(["serve", *argv])
        return Settings(**{k: v for k, v in vars(args).items() if k in Settings.model_fields})

    assert Settings().prefix_sharing is None
    assert settings("--device", "cpu").prefix_min_tokens_in_use == 0  # float32 within 1e-5, not bit for bit
    assert settings("--device", "cuda").prefix_min_tokens_in_use == 64  # the measured kinds: bit for bit
    assert settings("--device", "cuda:1", "--world-size", "2").prefix_min_tokens_in_use == 64
    assert settings("--device", "cuda", "--world-size", "2", "--sp", "2").prefix_min_tokens_in_use == 0
    assert settings().prefix_min_tokens_in_use == (64 if torch.cuda.is_available() else 0)  # auto: as loading resolves it
    assert settings("--device", "cpu", "--prefix-sharing").prefix_min_tokens_in_use == 64
    assert settings("--prefix-sharing", "--prefix-min-tokens", "128").prefix_min_tokens_in_use == 128
    assert settings("--device", "cuda", "--prefix-sharing", "--no-prefix-sharing").prefix_min_tokens_in_use == 0


def test_the_pool_and_the_local_scorer_get_the_prefix_length_in_use(monkeypatch):
    import model_runtime.pool.pool as pool
    from service.backends import load_backend

    seen = []
    monkeypatch.setattr(pool, "start_pool", lambda d, starting=None: seen.append(d["prefix_min_tokens"]))
    for sharing, want in ((True, 64), (False, 0)):
        load_backend(Settings(world_size=2, prefix_sharing=sharing))
        local = load_backend(Settings(prefix_sharing=sharing))
        assert seen[-1] == want and local.scorer.prefix_min_tokens == want


def test_benchmark_dry_run_on_the_cpu(tmp_path):
    from bench.prefix_sharing import main

    result = main(["--preset", "tiny", "--device", "cpu", "--out", str(tmp_path), "--also-tokens", "0"])
    saved = json.loads((tmp_path / "prefix-sharing.json").read_text())
    assert set(saved["workloads"]) == {"rl_mix_groups_of_8", "groups_of_16_1k_prompt_2k_response", "groups_of_8_8k_prompt_1k_response"}
    for name, entry in saved["workloads"].items():
        assert entry["tokens_saved_in_one_row"] > 0 and entry["row_token_bound"] > 1, name
        # The head and attention are not saved: the FLOP bound is above 1 and below the token one.
        assert 1 < entry["flop_bound"] < entry["row_token_bound"], (name, entry["flop_bound"], entry["row_token_bound"])
        assert entry["first_pass_unshared_s"] > 0 and entry["first_pass_shared_s"] > 0, name
        # float32 on the CPU: shared and unshared agree to rounding (1e-5, docs/prefix-sharing.md).
        assert entry["logprob_max_diff"] <= 1e-5, f"{name}: max |dlogp| {entry['logprob_max_diff']:.3e} > 1e-5"
    assert saved["speedup"] == result["speedup"] > 0
    assert (tmp_path / "prefix-sharing.md").read_text().startswith("prefix sharing, tiny")


def test_benchmark_one_workload_one_pass(tmp_path):
    from bench.prefix_sharing import main

    main(["--preset", "tiny", "--device", "cpu", "--out", str(tmp_path), "--also-tokens", "16384",
          "--workloads", "rl_mix_groups_of_8", "--passes", "1"])
    saved = json.loads((tmp_path / "prefix-sharing.json").read_text())
    # the smaller rows are the RL mix's too, so they still run
    assert set(saved["workloads"]) == {"rl_mix_groups_of_8", "rl_mix_groups_of_8_rows_of_16384"}
    assert saved["timed_pass"] == "only" and all("first_pass_speedup" not in e for e in saved["workloads"].values())
    assert "timed: the only pass" in (tmp_path / "prefix-sharing.md").read_text()
    with pytest.raises(SystemExit, match="unknown"):
        main(["--preset", "tiny", "--device", "cpu", "--out", str(tmp_path), "--workloads", "rl_mix"])


def test_benchmark_other_draws_of_the_rl_mix(tmp_path):
    from bench.prefix_sharing import main

    main(["--preset", "tiny", "--device", "cpu", "--out", str(tmp_path), "--also-tokens", "0", "--passes", "1",
          "--seeds", "0,3", "--workloads", "rl_mix_groups_of_8,rl_mix_groups_of_8_seed_3"])
    saved = json.loads((tmp_path / "prefix-sharing.json").read_text())
    assert set(saved["workloads"]) == {"rl_mix_groups_of_8", "rl_mix_groups_of_8_seed_3"}  # seed 0 is the mix itself
    draws = saved["rl_mix_over_seeds"]
    assert draws["seeds"] == [0, 3]
    for i, name in enumerate(("rl_mix_groups_of_8", "rl_mix_groups_of_8_seed_3")):
        entry = saved["workloads"][name]
        assert draws["speedup"][i] == entry["by_prompt"]["speedup"] and 0 < draws["repeated_prompt_fraction"][i] < 1
    assert saved["workloads"]["rl_mix_groups_of_8"]["workload"] != saved["workloads"]["rl_mix_groups_of_8_seed_3"]["workload"]
    assert draws["mean_speedup"] == pytest.approx(sum(draws["speedup"]) / 2)
    assert draws["as_served_speedup"][0] == saved["workloads"]["rl_mix_groups_of_8"]["speedup"] == saved["speedup"]
    assert "| mean |" in (tmp_path / "prefix-sharing.md").read_text()
    # a draw asked for first runs whatever the time left: it is the headline then
    main(["--preset", "tiny", "--device", "cpu", "--out", str(tmp_path), "--also-tokens", "0", "--passes", "1",
          "--seeds", "3", "--workloads", "rl_mix_groups_of_8_seed_3", "--budget-s", "0"])
    alone = json.loads((tmp_path / "prefix-sharing.json").read_text())
    assert set(alone["workloads"]) == {"rl_mix_groups_of_8_seed_3"}
    assert alone["speedup"] == alone["workloads"]["rl_mix_groups_of_8_seed_3"]["speedup"]


def test_one_row_profiled_three_ways_on_the_cpu(tmp_path):
    from bench.prefix_sharing import main

    result = main(["--preset", "tiny", "--device", "cpu", "--out", str(tmp_path), "--profile-row"])
    profile = json.loads((tmp_path / "prefix-sharing.json").read_text())["row_profile"]
    assert profile == json.loads(json.dumps(result["row_profile"]))
    assert profile["sequences"] % 8 == 0 and profile["tokens"] <= 65536, "whole groups of one unshared row"
    sides = profile["sides"]
    assert list(sides) == ["unshared", "as served", "every member"]
    assert sides["unshared"]["tokens_run"] == profile["tokens"]
    assert sides["every member"]["tokens_run"] <= sides["as served"]["tokens_run"] < profile["tokens"]
    assert sides["every member"]["flops"] < sides["unshared"]["flops"]
    for name, side in sides.items():
        assert side["modules"]["linear_attn"]["count"] > 0 and side["modules"]["mlp"]["count"] > 0, name
        assert side["modules"]["wall_ms"] > 0, name
    text = (tmp_path / "prefix-sharing.md").read_text()
    assert text.startswith("one row of") and "| every member |" in text and "n/a" in text


def test_flop_bounds_from_the_preset_shape_alone():
    from bench.prefix_sharing import main

    bounds = main(["--preset", "tiny", "--flops-only", "--out", "unused"])
    for name, b in bounds.items():
        assert 1 < b["flop_bound"] < b["row_token_bound"], (name, b)


def test_a_row_takes_a_groups_members_together_not_largest_first_across_groups():
    rng = np.random.default_rng(3)
    # two groups whose members alternate by length: 700, 650, 600, ... tokens
    request = group(rng, 300, [400, 300, 200, 100]) + group(rng, 300, [350, 250, 150, 50])
    # each group runs 256 shared + its members' own tokens: 1,432 and 1,232, one row each; largest
    # first across the groups would take three rows (1,494 + 1,488 + 450 tokens)
    rows, saved = schedule_once(request, max_batch_tokens=1500, prefix_min_tokens=64)
    assert rows == [[700, 600, 500, 400], [650, 550, 450, 350]], rows
    assert saved == 6 * 256, saved


def test_the_scheduler_packs_a_trainers_burst_nearly_as_tightly_as_offline_scoring():
    from bench.burst_packing import measure

    rows = measure([16384])["rows"]["16384"]
    # tokens the rows run, shared prompts counted once: offline packing keeps each group whole
    assert rows["scheduler"]["of_offline"] <= 1.03, rows
    assert rows["scheduler"]["run_tokens"] < rows["scheduler_largest_first"]["run_tokens"], rows
