"""The benchmark figures quoted in the README and the guides are generated from the JSON
results (`python -m benchmarks.report`), so they cannot drift from them."""

import json
import math
import re

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
        run_s=1.1 * 256 / paths_per_sec,
        run_min_s=256 / paths_per_sec,
        run_max_s=1.2 * 256 / paths_per_sec,
        cpu_s=cpu_s,
        rounds=9,
        repeats=9,
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
    # The fastest call with its spread (the median call 10% above it).
    assert "| 2 | 2 | 2 | 1.35 s (+10%) | 190 | 1.9 | 0.95 | 1.05 |" in table
    assert "256 paths of 1000 steps" in table
    assert max(line.count("|") - 1 for line in table.splitlines()) <= 8
    text = "a <!-- generated:ensemble-summary -->old<!-- /generated:ensemble-summary --> b"
    assert report.fill(text, figures) == (
        f"a <!-- generated:ensemble-summary -->{figures['ensemble-summary']}"
        "<!-- /generated:ensemble-summary --> b"
    )
    # Results in the old format (no processes axis) are not quoted.
    del rows[0]["processes"]
    (tmp_path / "ensemble-cpu-cpu.json").write_text(json.dumps(payload))
    assert "not measured yet" in report.figures()["ensemble-summary"]


def _quoted_from_the_accelerator(tmp_path, monkeypatch, payload, figure) -> str:
    """The generated `figure` from `payload` recorded as a TPU's result, after checking
    that neither no result nor the same result recorded as a CPU-only run is quoted."""
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    name = payload["benchmark"]
    assert "not measured" in report.figures()[figure]
    (tmp_path / f"{name}-cpu-cpu.json").write_text(json.dumps(payload))
    assert "not measured" in report.figures()[figure]
    (tmp_path / f"{name}-tpu-tpu-v5-lite.json").write_text(json.dumps(payload))
    return report.figures()[figure]


def test_stiff_device_figures(tmp_path, monkeypatch):
    def row(problem, size, device, run_min_s, rtol=1e-4, method="ours BDF var"):
        unknowns = 3 * size if problem == "robertson" else 2 * size**2
        return dict(
            problem=problem, size=size, unknowns=unknowns, rtol=rtol, method=method,
            device=device, run_min_s=run_min_s,
        )  # fmt: skip

    rows = [
        row("robertson", 1, "tpu", 0.02),
        row("robertson", 1, "cpu", 0.002),
        row("robertson", 1, "tpu", 1.0, rtol=1e-5),  # another tolerance: not quoted
        row("robertson", 1, "tpu", 1.0, method="ours Rodas5P"),  # another method: not quoted
        row("robertson", 10_000, "tpu", 0.1),
        row("robertson", 10_000, "cpu", 0.4),
        row("brusselator_2d", 16, "tpu", 0.006),
        row("brusselator_2d", 16, "cpu", 0.006),
        row("brusselator_2d", 64, "tpu", 0.015),
        row("brusselator_2d", 64, "cpu", 0.045),
    ]
    machine = {"platform": "tpu", "device": "TPU v5 lite", "cpu_count": 13, "date": "2026-12-06"}
    payload = {"benchmark": "stiff_device", "machine": machine, "rows": rows}
    text = _quoted_from_the_accelerator(tmp_path, monkeypatch, payload, "stiff-device")
    assert text.startswith("On one TPU v5 lite (`benchmarks/results/stiff_device-tpu-")
    assert "same machine's 13-core CPU" in text
    # The accelerator's time over the CPU's, smallest and largest size of each problem.
    assert "1 Robertson system(s) (3 unknowns) in 20.00 ms against 2.00 ms (10x)" in text
    assert "10,000 Robertson system(s) (30,000 unknowns) in 100.00 ms against 400.00 ms" in text
    assert "(0.25x)" in text
    assert "the 16 x 16 Brusselator (512 unknowns) in 6.00 ms against 6.00 ms (1x)" in text
    assert "the 64 x 64 Brusselator (8,192 unknowns)" in text and "(0.333x)" in text


def test_materialise_seed_figures(tmp_path, monkeypatch):
    def row(method, run_min_s, error):
        return dict(
            problem="A @ x (seed size)", N=10_000, method=method, run_min_s=run_min_s,
            max_error_over_max_A=error,
        )  # fmt: skip

    first = dict(problem="first call A @ x", N=10_000, method="ours (eager)", first_s=0.6)
    rows = [row("jax.jacfwd", 0.012, 2.1e-3), row("ours", 0.002, 0.0), first]
    machine = {"platform": "tpu", "device": "TPU v5 lite", "date": "2026-12-06T09:00:00"}
    payload = {"benchmark": "materialise_seed", "machine": machine, "rows": rows}
    text = _quoted_from_the_accelerator(tmp_path, monkeypatch, payload, "materialise-seed-device")
    assert text.startswith("On one TPU v5 lite (2026-12-06, `benchmarks/results/materialise_")
    assert "N = 10,000 and the default matmul precision" in text
    assert "takes 12.00 ms and returns `A` with entries off by up to 2.1e-03 times" in text
    assert text.endswith("`materialise` takes 2.00 ms and returns `A` exactly")
    payload["matmul_precision"] = "highest"
    rows[0]["max_error_over_max_A"] = 0.0
    (tmp_path / "materialise_seed-tpu-tpu-v5-lite.json").write_text(json.dumps(payload))
    text = report.figures()["materialise-seed-device"]
    assert "the highest matmul precision" in text
    assert "takes 12.00 ms and returns `A` exactly;" in text


def _same_up_to_rounding(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        # A measurement that failed is recorded as NaN (an unstable fixed step's error).
        both_nan = math.isnan(a) and math.isnan(b)
        return a == b or both_nan or math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_up_to_rounding(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(_same_up_to_rounding, a, b))
    return type(a) is type(b) and a == b


def test_same_up_to_rounding():
    assert _same_up_to_rounding({"r": [1.5028062811674323]}, {"r": [1.5028062811674283]})
    assert not _same_up_to_rounding({"r": [1.50280628]}, {"r": [1.50280629]})
    assert not _same_up_to_rounding({"r": 1}, {"r": 1.0})
    assert not _same_up_to_rounding({"r": "a"}, {"r": "b"})
    assert _same_up_to_rounding({"r": math.nan}, {"r": math.nan})
    assert not _same_up_to_rounding({"r": math.nan}, {"r": 1.0})


@pytest.mark.parametrize("path", sorted(report.RESULTS.glob("*.json")), ids=lambda p: p.stem)
def test_derived_numbers_are_those_of_the_timings(path):
    # The ratios and summaries in the JSON are recomputed from its timings by the
    # benchmark's `derive`, each ours over the other (`python -m benchmarks.report
    # --rederive` rewrites them without re-timing).
    # Up to rounding: NumPy releases differ in the last bits of `log`/`exp` (the newest
    # releases' leg of .ci/run derived 1.5028062811674283 for a recorded ...323).
    data = json.loads(path.read_text())
    assert _same_up_to_rounding(report.derived(json.loads(path.read_text())), data), (
        f"{path.name}: its ratios or summary are not those of its timings: run "
        "`python -m benchmarks.report --rederive`"
    )


#
# Hand-written figures: none in the prose of the README and the guides.
#

ROOT = report.ROOT
# A measured quantity as prose writes one: a ratio, a time, a memory size or a rate.
_FIGURE = re.compile(
    r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:x(?!\w)|\s?(?:µs|ms|s|MiB|GiB)(?!\w)|\s?paths/s)"
)
# Figures in the prose that are not benchmark results, by page, and why.
_TEST_DURATION = "durations of Diffrax's tests in one run (a record, not a benchmark)"
NOT_MEASURED = {
    "docs/devdocs/diffrax_tests.md": {
        "8 MiB": "the default stack size of a thread",
        "39 s": _TEST_DURATION,
        "55 s": _TEST_DURATION,
        "169 s": _TEST_DURATION,
        "214 s": _TEST_DURATION,
        "265 s": _TEST_DURATION,
        "30 s": _TEST_DURATION,
        "47 s": _TEST_DURATION,
        "56 s": _TEST_DURATION,
        "49 s": _TEST_DURATION,
    },
    "docs/devdocs/structure_engine.md": {"1 MiB": "a threshold of the constant cache"},
    "docs/ensembles.md": {
        "60 s": "a timeout",
        "10 s": "a timeout of the multi-process test",
        "5 s": "a timeout of the multi-process test",
        "3.4x": "the wrong figure of an earlier version, quoted as such",
    },
    "docs/squared_grads.md": {"1.42x": "an operation count, not a timing"},
}


def _prose(path) -> str:
    """`path`'s text without its code, its generated regions and the README's table."""
    text = path.read_text()
    start, end = text.find(report.README_START), text.find(report.README_END)
    text = text[:start] + text[end:] if start >= 0 else text
    text = report._GENERATED.sub("", text)
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def _pages():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [p for p in pages if p != report.DOCS]


def _name(path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("path", _pages(), ids=_name)
def test_no_hand_written_benchmark_figures(path):
    # A measured figure in prose is generated from the JSON by `python -m benchmarks.report`
    # (between `<!-- generated:NAME -->` markers, a piece of `report.figures()`), so that it
    # cannot drift from the results: "1.49x" beside a table that says 1.06x.
    allowed = NOT_MEASURED.get(_name(path), {})
    found = [m[0] for m in _FIGURE.finditer(_prose(path)) if m[0] not in allowed]
    assert not found, (
        f"{_name(path)}: figures written by hand: {found}. Generate them from the JSON "
        "(`benchmarks/report.py`'s `figures()`) or, if they are not benchmark results, list "
        "them in NOT_MEASURED with the reason"
    )


def test_not_measured_figures_are_still_there():
    for name, figures in NOT_MEASURED.items():
        found = {m[0] for m in _FIGURE.finditer(_prose(ROOT / name))}
        assert set(figures) <= found, (name, set(figures) - found)


def _readme_row(what: str) -> str:
    (line,) = [x for x in report.README.read_text().splitlines() if x.startswith(f"| {what}")]
    return line


def test_readme_step_cost_compares_fastest_rounds():
    # By medians the diagonal Milstein step came out below the Euler step it contains: on
    # a busy machine a median of a microsecond step carries the load. The README quotes
    # minima.
    data = json.loads((report.RESULTS / "step_cost-cpu-cpu.json").read_text())
    rows = {(r["diffusion"], r["d"], r["solver"]): r for r in data["rows"]}
    # By minima too the diagonal step came out below 1x Euler, its median above Euler's:
    # where the spreads (fastest to median round) overlap, the README says the ratio is
    # within them (issue 26), not a Milstein step cheaper than an Euler step.
    for diffusion, d, what in (
        ("diagonal", 1024, "diagonal"),
        ("row_scaled", 256, "`g_ij"),
        ("dense_linear", 256, "`g(y) = A y`"),
    ):
        ours, euler = rows[(diffusion, d, "ours_ito")], rows[(diffusion, d, "euler")]
        line = _readme_row(f"Itô Milstein step, {what}")
        ratio = ours["run_min_s"] / euler["run_min_s"]
        assert "fastest round" in line
        assert f"{report._fmt3(ours['run_min_s'])} (" in line, line
        assert f"{ratio:.1f}x Euler)" in line, line
        overlap = ours["run_min_s"] <= euler["run_s"] and euler["run_min_s"] <= ours["run_s"]
        assert ("within the spread" in line) == overlap, line


def test_extrapolated_costs_say_how_far():
    # Euler-Maruyama's cost at RMS error 1e-3 lies about 80x past the steps measured.
    data = json.loads((report.RESULTS / "work_precision-cpu-cpu.json").read_text())
    (e,) = [s for s in data["summary"] if s["m"] == 10 and s["method"].startswith("Euler-Maruyama")]
    most = max(r["steps"] for r in data["rows"] if (r["m"], r["method"]) == (10, e["method"]))
    how = f"extrapolated {e['steps_at_1e_3'] / most:.0f}x past the {most} steps measured"
    assert how in _readme_row("non-commutative noise, m=10")
    assert how in report.DOCS.read_text()


def test_squared_grads_guide_quotes_generated_figures():
    text = (ROOT / "docs" / "squared_grads.md").read_text()
    assert set(report._squared_grads_figures()) == set(report.SQUARED_GRADS_FIGURES)
    for name in report.SQUARED_GRADS_FIGURES:
        assert f"<!-- generated:{name} -->" in text, name


def test_partial_rerun_keeps_older_rows_with_their_dates(tmp_path, monkeypatch):
    from benchmarks import _common

    monkeypatch.setattr(_common, "RESULTS", tmp_path)
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    first = {"date": "2026-12-01T10:00:00+00:00", "platform": "cpu", "versions": {"jax": "1"}}
    rows = [{"field": "a", "unknowns": 1}, {"field": "b", "unknowns": 1}]
    payload = {"benchmark": "structure", "machine": first, "machine_note": "idle", "rows": rows}
    path = tmp_path / f"{_common.result_stem('structure')}.json"
    path.write_text(json.dumps(payload))
    kept, runs = _common.kept_rows("structure", lambda r: r["field"] == "b")
    assert kept == [{"field": "a", "unknowns": 1, "recorded": first["date"]}]
    assert runs == [{"machine": first, "machine_note": "idle"}]
    # A second partial re-run, of `a`, keeps `b` with the date of the run that measured it,
    # and names only the runs some kept row still comes from.
    second = {**first, "date": "2026-12-02T10:00:00+00:00"}
    rows = [*kept, {"field": "b", "unknowns": 1, "recorded": second["date"]}]
    payload = {"benchmark": "structure", "machine": second, "earlier_runs": runs, "rows": rows}
    path.write_text(json.dumps(payload))
    kept, runs = _common.kept_rows("structure", lambda r: r["field"] == "a")
    assert kept == [{"field": "b", "unknowns": 1, "recorded": second["date"]}]
    assert runs == [{"machine": second, "machine_note": None}]
    assert _common.kept_rows("missing", lambda r: True) == ([], [])
    line = report._earlier_runs(payload)
    assert "(the rows of a)" in line and "recorded 2026-12-01T10:00:00+00:00 (idle)" in line
    assert report._earlier_runs({"machine": second, "rows": rows}) == ""


def _fake_stiff_peers_row(problem, size, rtol, method, run_min_s=1.0, **extra):
    return dict(
        problem=problem, size=size, rtol=rtol, atol=rtol, method=method, compile_s=0.5,
        run_min_s=run_min_s, run_s=1.1 * run_min_s, run_max_s=1.2 * run_min_s, cpu_s=run_min_s,
        rounds=3, repeats=3, accepted_steps=10, rejected_steps=2, ok=True, mescd=6.0, **extra,
    )  # fmt: skip


def test_stiff_peers_partial_rerun(tmp_path, monkeypatch):
    # `--update` on a tiny fake record, the solves replaced by rows made up here: the rows
    # not re-run are kept with their date, the new ones stamped with the run's, in the
    # sweep's order, and the derived sections are those of the merged rows.
    from benchmarks import _common, stiff_peers

    monkeypatch.setattr(_common, "RESULTS", tmp_path)
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    calls = []
    first = {"date": "2026-12-01T10:00:00+00:00", "platform": "cpu", "versions": {"jax": "1"}}

    def run_case(problem, size, *, methods, rtols, slow_s, **kw):
        calls.append((problem, size, tuple(methods)))
        return [
            _fake_stiff_peers_row(problem, size, rtol, m, run_min_s=0.25) for rtol in rtols
            for m in methods
        ]  # fmt: skip

    def setup(*args):
        return dict(rtols=[1e-4, 1e-6], methods=stiff_peers.JAX_METHODS + stiff_peers.PEERS)

    def loop_floor():
        calls.append("loop floor")
        return {"new floor": {"run_min_s": 1e-3, "steps": 1000, "s_per_step": 1e-6}}

    dates = iter(["2026-12-02T10:00:00+00:00", "2026-12-03T10:00:00+00:00"])
    for name, value in [
        ("machine", lambda: {**first, "date": next(dates)}), ("_run_case", run_case),
        ("_test_set_case", setup), ("_robertson_case", setup),
        ("_brusselator_case", setup), ("_loop_floor", loop_floor), ("self_check", dict),
        ("_peer_versions", lambda: {"scipy": "2"}), ("plot", lambda *a, **k: None),
    ]:  # fmt: skip
        monkeypatch.setattr(stiff_peers, name, value)
    old_rows = [
        _fake_stiff_peers_row(p, s, rtol, m)
        for p, s in [("HIRES", 8), ("robertson", 1), ("brusselator_2d", 64)]
        for rtol in (1e-4, 1e-6)
        for m in ("ours VeryChord", "ours BDF", "scipy BDF")
    ]
    floor = {"old floor": {"run_min_s": 1e-3, "steps": 100, "s_per_step": 1e-5}}
    record = {
        "benchmark": "stiff_peers", "machine": first, "machine_note": "idle",
        "peer_versions": {"scipy": "1"}, "loop_floor": floor, "rows": old_rows,
    }  # fmt: skip
    path = tmp_path / f"{_common.result_stem('stiff_peers')}.json"
    path.write_text(json.dumps(stiff_peers.derive(record)))

    stiff_peers.main(["--problems", "brusselator_2d", "--sizes", "64", "--update"])
    assert calls == [("brusselator_2d", 64, tuple(stiff_peers.JAX_METHODS + stiff_peers.PEERS))]
    data = json.loads(path.read_text())
    second = data["machine"]["date"]
    assert second == "2026-12-02T10:00:00+00:00"
    old = [r for r in data["rows"] if r["problem"] != "brusselator_2d"]
    assert old == [{**r, "recorded": first["date"]} for r in old_rows[:12]]
    new = [r for r in data["rows"] if r["problem"] == "brusselator_2d"]
    methods = stiff_peers.JAX_METHODS + stiff_peers.PEERS
    assert len(new) == 2 * len(methods) and {r["recorded"] for r in new} == {second}
    assert [r["method"] for r in new[:3]] == stiff_peers.JAX_METHODS[:3]
    assert data["earlier_runs"] == [
        {"machine": first, "machine_note": "idle", "peer_versions": {"scipy": "1"}}
    ]
    # Robertson N = 1 was not re-run: the loop floor is kept beside its cost per step.
    assert data["loop_floor"] == floor
    assert data["per_step"]["ours BDF"] == {"run_min_s": 1.0, "steps": 12, "s_per_step": 1 / 12}
    assert _same_up_to_rounding(report.derived(data), data)
    line = report._earlier_runs(data)
    assert "(the rows of HIRES 8, robertson 1)" in line, line
    assert "recorded 2026-12-01T10:00:00+00:00 (idle)" in line

    # One contender added to every case: the loop floor is measured again with
    # Robertson N = 1, and the other contenders' rows are kept.
    calls.clear()
    stiff_peers.main(["--methods", "ours Rodas5P", "--update"])
    cases = [(p, s) for p, s, _ in stiff_peers.cases()]
    assert calls == [*((p, s, ("ours Rodas5P",)) for p, s in cases), "loop floor"]
    before = data["rows"]
    data = json.loads(path.read_text())
    assert len(data["rows"]) == len(before) + 2 * len(cases) - 2  # brusselator's replaced
    assert [r for r in data["rows"] if r["method"] != "ours Rodas5P"] == [
        r for r in before if r["method"] != "ours Rodas5P"
    ]
    assert data["loop_floor"] == loop_floor()
    assert [r["method"] for r in data["rows"][:4]] == [
        "ours VeryChord", "ours Rodas5P", "ours BDF", "scipy BDF"
    ]  # fmt: skip
    assert _same_up_to_rounding(report.derived(data), data)
    assert [r["machine"]["date"] for r in data["earlier_runs"]] == [first["date"], second]
    # The summary's ratios are of the merged rows: ours VeryChord (kept, 1 s) over the
    # added contender (0.25 s).
    hires = {s["method"]: s for s in data["summary"] if s["case"] == "HIRES 8, rtol 1e-06"}
    assert hires["ours Rodas5P"]["vs_verychord"] == "4x"
    assert hires["scipy BDF"]["vs_verychord"] == "1x"
    line = report._earlier_runs(data)
    assert "(the rows of HIRES 8, brusselator_2d 64, robertson 1)" in line, line


def test_stiff_peers_full_and_quick_sweeps_keep_their_cases():
    from benchmarks import stiff_peers

    assert [(p, s) for p, s, _ in stiff_peers.cases(quick=True)] == [
        ("HIRES", 8), ("ROBER", 3), ("robertson", 1), ("robertson", 100), ("brusselator_2d", 16)
    ]  # fmt: skip
    full = [(p, s) for p, s, _ in stiff_peers.cases()]
    assert full[:5] == [("HIRES", 8), ("OREGO", 3), ("POLLU", 20), ("ROBER", 3), ("VDPOL", 2)]
    assert full[5:] == [("robertson", N) for N in (1, 10, 100, 1000, 10_000)] + [
        ("brusselator_2d", n) for n in (16, 32, 64)
    ]
    with pytest.raises(SystemExit):
        stiff_peers.main(["--update"])  # names no case
    with pytest.raises(SystemExit):
        stiff_peers.main(["--problems", "HIRES", "--sizes", "64", "--update"])


def test_stiff_peers_time_at_digits_by_hand():
    # Ours' runs from the loosest rtol: 4.0 digits in 40 ms, 5.0 in 80 ms, 4.8 in 70 ms (a
    # work-precision curve is not monotone), 6.0 in 100 ms.
    from benchmarks.stiff_peers import time_at_digits

    points = [(1e-5, 6.0, 0.1), (1e-4, 4.0, 0.04), (10**-4.25, 5.0, 0.08), (10**-4.5, 4.8, 0.07)]
    t, how, rtols, gap = time_at_digits(points, 4.5)
    # Half way in digits between 40 and 80 ms: their geometric mean.
    assert how == "interpolated" and rtols == (1e-4, 10**-4.25) and gap == 1.0
    assert t == pytest.approx(math.sqrt(0.04 * 0.08))
    # The first crossing as the rtol tightens, not the pair (4.8, 5.0) nearer in digits.
    assert time_at_digits(points, 4.9)[2] == (1e-4, 10**-4.25)
    # 5.5 digits: first bracketed by 4.8 (70 ms) and 6.0 (100 ms), 0.7 / 1.2 of the way.
    t, how, rtols, gap = time_at_digits(points, 5.5)
    assert rtols == (10**-4.5, 1e-5) and gap == pytest.approx(1.2)
    assert t == pytest.approx(0.07 ** (5 / 12) * 0.1 ** (7 / 12))
    # Below the loosest run's digits: its time, a bound; above every run's: none.
    assert time_at_digits(points, 3.5) == (0.04, "at most", (1e-4, 1e-4), 0.0)
    assert time_at_digits(points, 6.5) is None
    assert time_at_digits([(1e-4, None, None)], 4.0) is None


def test_stiff_peers_equal_accuracy_rows():
    # The runs between decades of rtol serve the equal-accuracy reading (and report.py's
    # table of it) but not the per-row summary; only the peers and problems it names count.
    from benchmarks import stiff_peers

    def row(rtol, method, mescd, run_min_s, problem="brusselator_2d", **extra):
        fake = _fake_stiff_peers_row(problem, 64, rtol, method, run_min_s=run_min_s, **extra)
        return {**fake, "mescd": mescd}

    ours = "ours BDF var"
    rows = [
        row(1e-4, ours, 4.0, 0.04),
        row(1e-4, "CVODE GMRES", 4.5, 0.05),
        row(1e-4, "diffsol BDF", 4.2, 0.03),
        row(1e-4, "scipy BDF", 4.5, 0.001),
        row(1e-4, "CVODE GMRES", 4.5, 0.05, problem="HIRES"),
        row(10**-4.25, ours, 5.0, 0.08, between=True),
        row(1e-6, ours, 6.0, 0.1),
    ]
    got = stiff_peers.equal_accuracy(rows)
    assert [(r["peer"], r["how"]) for r in got] == [
        ("CVODE GMRES", "interpolated"),
        ("diffsol BDF", "interpolated"),
    ]
    assert got[0]["ratio"] == pytest.approx(math.sqrt(0.04 * 0.08) / 0.05)
    # 4.2 digits: a fifth of the way from 40 to 80 ms.
    assert got[1]["ours_s"] == pytest.approx(0.04 * 2**0.2)
    assert got[0]["ours_rtols"] == (1e-4, 10**-4.25) and got[0]["gap"] == 1.0
    cases = [(s["case"], s["method"]) for s in stiff_peers._summary(rows)]
    assert ("brusselator_2d 64, rtol 1e-06", ours) in cases
    assert not any("rtol 5.6" in c for c, _ in cases) and len(cases) == 6
    # report.py's table: per case and rtol the peer ours is furthest behind.
    text = "\n".join(report._equal_accuracy(got))
    # diffsol: 30 ms, where ours takes 40 * 2**0.2 = 45.9 ms; CVODE GMRES only 1.13x.
    assert "diffsol BDF: 30.00 ms, 4.20 digits" in text and "| 1.53x |" in text
    assert "CVODE GMRES" not in text


def test_stiff_peers_between_rtols():
    from benchmarks import stiff_peers

    got = stiff_peers._between_rtols([1e-4, 1e-6, 1e-8])
    # Every quarter decade from 1e-4 to 1e-8 but the two ends and 1e-6.
    want = [10 ** -(d + k / 4) for d in (4, 5, 6, 7) for k in range(4) if (d, k) != (6, 0)][1:]
    assert got == pytest.approx(want, rel=1e-12)
