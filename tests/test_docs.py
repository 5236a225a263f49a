"""The documentation: every public name has an API entry, and the guides' code runs."""

import pathlib
import re

import diffrax_linearize as dl
import diffrax_linearize.internal as internal
import pytest


DOCS = pathlib.Path(__file__).parent.parent / "docs"


def _documented() -> set[str]:
    names = set()
    for page in (DOCS / "api").glob("*.md"):
        names |= set(re.findall(r"^::: (diffrax_linearize[\w.]*)", page.read_text(), re.M))
    return names


def _public(module, prefix) -> set[str]:
    return {
        f"{prefix}.{name}"
        for name in dir(module)
        if not name.startswith("_") and not isinstance(getattr(module, name), type(dl))
    }


def test_every_public_name_is_documented():
    documented = _documented()
    missing = (
        _public(dl, "diffrax_linearize") | _public(internal, "diffrax_linearize.internal")
    ) - documented
    assert not missing, f"public names with no `::: name` entry under docs/api/: {sorted(missing)}"


def test_documented_names_exist():
    for name in _documented():
        obj = dl
        for part in name.split(".")[1:]:
            obj = getattr(obj, part)


def _code_blocks(page: str) -> list[str]:
    text = (DOCS / page).read_text()
    return re.findall(r"```python\n(.*?)```", text, re.S)


@pytest.mark.parametrize("page", ["index.md", "terms.md", "milstein.md", "squared_grads.md"])
def test_guide_code_runs(page):
    blocks = _code_blocks(page)
    assert blocks, f"no python code in docs/{page}"
    namespace: dict = {}
    exec(compile("\n".join(blocks), f"docs/{page}", "exec"), namespace)


#
# The generated benchmarks page
#


def test_case_keys_name_each_recorded_row_once():
    # The side-by-side tables join machines on these keys: each must name one row.
    import json

    from benchmarks import report

    for path in sorted(report.RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        keys = report.CASE_KEYS[data["benchmark"]]
        cases = [tuple(row[k] for k in keys) for row in data["rows"]]
        assert len(cases) == len(set(cases)), path.name


def test_side_by_side_table(tmp_path, monkeypatch):
    import json

    from benchmarks import report

    def write(stem, rows):
        payload = {"benchmark": "materialise", "machine": {"platform": stem}, "rows": rows}
        (tmp_path / f"materialise-{stem}.json").write_text(json.dumps(payload))

    row = dict(problem="A@x", N=100, method="ours", repeats=3)
    write("cpu-cpu", [dict(row, run_s=2e-3, compile_s=0.5), dict(row, N=200, run_s=0.25)])
    write("gpu-nvidia-h200", [dict(row, run_s=4e-5, compile_s=1.5)])
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    page = report.render()
    assert "### Side by side" in page
    head = "| problem | N | method | run (cpu-cpu) | compile (cpu-cpu) | run (gpu-nvidia-h200) |"
    assert head in page
    assert "| A@x | 100 | ours | 2.00 ms | 500.00 ms | 40 µs | 1.50 s |" in page
    assert "| A@x | 200 | ours | 250.00 ms | — | — | — |" in page
    # One machine only: no side-by-side table.
    (tmp_path / "materialise-gpu-nvidia-h200.json").unlink()
    assert "Side by side" not in report.render()
