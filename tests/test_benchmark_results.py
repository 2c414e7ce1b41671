"""benchmarks/RESULTS.md and the README's headline table are generated from benchmarks/results/*.json by
benchmarks/report.py: this fails when either differs from what the results files generate (a hand edit, or a
results file recorded without `python benchmarks/report.py --write`), and when a results file lacks what a
reader needs to reproduce it (device, date, torch, and per run the command and the time)."""
import importlib.util
import json
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def _report():
    spec = importlib.util.spec_from_file_location("bench_report", os.path.join(ROOT, "benchmarks", "report.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


report = _report()


def _read(*parts):
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def test_results_files_name_device_date_and_commands():
    docs = report.load_results(RESULTS)
    assert {d["file"] for d in docs} >= {"h100-2026-11-22.json", "cpu-2026-11-22.json"}
    for doc in docs:
        assert doc["file"].endswith(f"-{doc['date']}.json"), doc["file"]
        for run in doc["runs"]:
            assert run["command"].split()[1].startswith("benchmarks/bench_"), run["command"]
            assert run["time"].startswith(doc["date"]), (doc["file"], run["time"])
            assert run["rows"], (doc["file"], run["time"])


def test_results_md_is_generated_from_the_results_files():
    expected = report.render_results(report.load_results(RESULTS))
    assert _read("benchmarks", "RESULTS.md") == expected, (
        "benchmarks/RESULTS.md is not what benchmarks/results/ generates: "
        "run `python benchmarks/report.py --results benchmarks/results --write`")


def test_readme_headline_table_is_generated_from_the_results_files():
    readme = _read("README.md")
    table = report.render_readme_table(report.load_results(RESULTS))
    assert table in readme, ("README.md's headline table is not what benchmarks/results/ generates: "
                             "run `python benchmarks/report.py --results benchmarks/results --write`")
    assert report.replace_between_markers(readme, table) == readme


def test_a_recorded_run_supersedes_only_the_cells_it_measured(tmp_path):
    """--add of a bench_gpu output: a new file for a new date; in a file, the latest run's row wins per cell."""
    doc = json.loads(_read("benchmarks", "results", "h100-2026-11-22.json"))
    grid = next(r for r in doc["runs"] if r["script"] == "bench_gpu.py")
    row = next(r for r in grid["rows"] if (r["op"], r["provider"]) == ("ce", "rl_losses"))
    other = next(r for r in grid["rows"] if (r["op"], r["provider"]) == ("grpo", "rl_losses")
                 and (r["n"], r["v"]) == (row["n"], row["v"]))
    meta = {"date": "2031-01-02 03:04 UTC", "command": "python3 benchmarks/bench_gpu.py --ops ce",
            "torch": "9.9", "device": doc["device"], "git": "abc1234", "copy_ceiling_gbps": 3000.4}
    out = tmp_path / "bench.json"
    for ms in (1.5, 1.25):  # the same run recorded twice replaces itself
        out.write_text(json.dumps({"meta": meta, "results": [{**row, "ms": ms}]}))
        target = report.add_run(str(out), str(tmp_path))
    assert os.path.basename(target) == "h100-2031-01-02.json"
    (tmp_path / "bench.json").unlink()
    new = json.loads(open(target).read())
    assert [len(r["rows"]) for r in new["runs"]] == [1] and new["runs"][0]["copy_ceiling_gbps"] == 3000
    doc["runs"].append({**new["runs"][0]})
    doc["file"] = "x.json"
    cells = report.latest_rows(doc, "bench_gpu.py", report._gpu_key)
    assert cells[("ce", row["n"], row["v"], "rl_losses")]["ms"] == 1.25
    assert cells[("grpo", row["n"], row["v"], "rl_losses")] == other


def test_a_results_file_without_a_command_is_refused(tmp_path):
    doc = json.loads(_read("benchmarks", "results", "cpu-2026-11-22.json"))
    del doc["runs"][0]["command"]
    (tmp_path / "cpu-2026-11-22.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="a run without 'command'"):
        report.load_results(str(tmp_path))
