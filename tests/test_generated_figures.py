"""The benchmark figures quoted in the README and the guides are generated from the JSON
results (`python -m benchmarks.report`), so they cannot drift from them."""

import json

import pytest
from benchmarks import report


@pytest.mark.parametrize("path", report.QUOTING, ids=lambda p: p.name)
def test_quoted_figures_are_current(path):
    text = path.read_text()
    assert "<!-- generated:" in text, path
    assert report.fill(text, report.figures()) == text, (
        f"{path.name} is out of date with benchmarks/results/: run `python -m benchmarks.report`"
    )


def _row(processes, devices, cores, paths_per_sec, cpu_s):
    base = 100.0
    return dict(
        processes=processes,
        devices=devices,
        cores=cores,
        paths=256,
        steps=1000,
        d=32,
        compile_s=2.0,
        run_s=256 / paths_per_sec,
        run_min_s=256 / paths_per_sec,
        cpu_s=cpu_s,
        repeats=7,
        paths_per_sec=paths_per_sec,
        speedup=paths_per_sec / base,
        efficiency=paths_per_sec / base / cores,
        cpu_ratio=cpu_s / 2.56,
    )


def test_ensemble_figures(tmp_path, monkeypatch):
    rows = [
        _row(1, 1, 1, 100.0, 2.56),
        _row(1, 2, 2, 150.0, 3.4),
        _row(2, 2, 2, 190.0, 2.7),
        _row(1, 1, 2, 60.0, 6.0),
    ]
    machine = {"platform": "cpu", "device": "cpu", "date": "2026-12-01"}
    payload = {"benchmark": "ensemble", "machine": machine, "rows": rows}
    (tmp_path / "ensemble-cpu-cpu.json").write_text(json.dumps(payload))
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    figures = report.figures()
    assert figures["ensemble-summary"] == (
        "100 paths/s on 1 core; 150 on 2 devices of one process (0.75 efficiency); "
        "190 on 2 processes (0.95 efficiency)"
    )
    table = figures["ensemble-table"]
    assert (
        "| 2 | 2 | 2 | 256 | 1000 | 2.00 s | 1.35 s | 2.70 s | 190 | 1.9 | 0.95 | 1.05 |" in table
    )
    text = "a <!-- generated:ensemble-summary -->old<!-- /generated:ensemble-summary --> b"
    assert report.fill(text, figures) == (
        f"a <!-- generated:ensemble-summary -->{figures['ensemble-summary']}"
        "<!-- /generated:ensemble-summary --> b"
    )
    # Results in the old format (no processes axis) are not quoted.
    del rows[0]["processes"]
    (tmp_path / "ensemble-cpu-cpu.json").write_text(json.dumps(payload))
    assert "not measured yet" in report.figures()["ensemble-summary"]


@pytest.mark.parametrize("path", sorted(report.RESULTS.glob("*.json")), ids=lambda p: p.stem)
def test_derived_numbers_are_those_of_the_timings(path):
    # The ratios and summaries in the JSON are recomputed from its timings by the
    # benchmark's `derive`, each ours over the other (`python -m benchmarks.report
    # --rederive` rewrites them without re-timing).
    data = json.loads(path.read_text())
    assert report.derived(data) == data, (
        f"{path.name}: its ratios or summary are not those of its timings: run "
        "`python -m benchmarks.report --rederive`"
    )
