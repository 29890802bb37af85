"""bench/h200.py, the one H200 entry, with stand-in parts: budgets stop a part, an extra whose
module is absent is reported, OUT gets at most 8 files and the combined table comes last."""

from bench import h200


def fake(name, code, budget_s=60.0, module=None):
    return h200.Part(name, ("-c", "import sys, json, pathlib; out = pathlib.Path(sys.argv[sys.argv.index('--out') + 1]); "
                            + code), budget_s, module)


def test_parts_run_in_order_within_their_budgets(tmp_path, capsys):
    parts = {
        "suite": fake("suite", "(out / 'suite.json').write_text(json.dumps({'headline': '36,980 tokens/s'})); "
                      "(out / 'suite.md').write_text('| a | b |\\n| --- | --- |\\n| 1 | 2 |\\n')"),
        "http_burst": fake("http_burst", "import time; time.sleep(30)", budget_s=1.0, module="h200"),
        "weights_swap": fake("weights_swap", "pass", module="no_such_module_here"),
        "prefix_sharing": fake("prefix_sharing", "[(out / f'{i}.json').write_text('{}') for i in range(12)]", module="h200"),
        "moe": fake("moe", "sys.exit(3)", module="h200"),
    }
    out = tmp_path / "out"
    rc = h200.main(["--mode", "all", "--out", str(out), "--work", str(tmp_path / "work"), "--total-s", "120"], parts)
    assert rc == 1, "a failed or stopped part must fail the call"
    files = sorted(p.name for p in out.iterdir())
    assert len(files) == h200.MAX_FILES and "summary.md" in files, f"the twelve JSON files fill OUT up to the cap: {files}"
    assert all(p.is_file() for p in out.iterdir()), "OUT holds no folders"
    summary = (out / "summary.md").read_text()
    table = summary.split("## all parts")[1]
    assert "| suite | ok |" in table and "36,980 tokens/s" in table
    assert "| http_burst | stopped after 1s |" in table
    assert "| weights_swap | not present |" in table
    assert "| moe | failed (exit 3) |" in table
    assert summary.index("| 1 | 2 |") < summary.index("## all parts"), "each part's own table precedes the combined one"
    assert capsys.readouterr().out.rstrip().endswith("| moe | failed (exit 3) | 0 |  |"), "the combined table is printed last"


def test_mode_names_parts_and_refuses_unknown_ones():
    assert h200.parse_mode("all") == ["suite", *h200.EXTRAS]
    assert h200.parse_mode("suite, tests suite") == ["suite", "tests"]
    try:
        h200.parse_mode("suite bogus")
    except SystemExit as exc:
        assert "bogus" in str(exc)
    else:
        raise AssertionError("an unknown part was accepted")


def test_the_suite_part_times_the_headline_against_hugging_face(monkeypatch):
    monkeypatch.setenv("SUITE_HF", "single")
    argv = h200.PARTS["suite"]().argv
    assert argv[:4] == ("-m", "bench.gpu_suite", "--mode", "ab") and argv[-2:] == ("--hf", "single")


def test_the_whole_moe_workload_with_hugging_face_gets_the_time_it_needs(monkeypatch):
    for name in ("MOE_SEQUENCES", "MOE_HF"):
        monkeypatch.delenv(name, raising=False)
    assert h200.PARTS["moe"]().budget_s == 300, "24 sequences with Hugging Face fit in 300 s"
    monkeypatch.setenv("MOE_SEQUENCES", "256")
    assert h200.PARTS["moe"]().budget_s == 500, "the whole workload with Hugging Face one at a time needs up to about 500 s"
    monkeypatch.setenv("MOE_HF", "none")
    assert h200.PARTS["moe"]().budget_s == 300, "packscore's own sides of the whole workload take about 100 s"
    monkeypatch.setenv("MOE_S", "123")
    assert h200.env_budget(h200.PARTS["moe"]()) == 123, "MOE_S overrides the default"
