"""The documentation: every public name has an API entry, and the code in README.md, the
docs pages and the docstrings runs."""

import contextlib
import inspect
import io
import pathlib
import re

import diffrax_linearize as dl
import diffrax_linearize.internal as internal
import jax
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


ROOT = DOCS.parent

# A code block whose first line starts with this comment is a template (it names things
# the reader supplies) and is not run.
TEMPLATE = "# Template:"
# A block whose first line is `# Excerpt from PATH ...` is quoted from the file at PATH
# (relative to the repository root), where it runs, and is not run here: its lines must
# be lines of that file.
EXCERPT = "# Excerpt from "


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def _runnable(blocks: list[str]) -> list[str]:
    return [b for b in blocks if not b.lstrip().startswith((TEMPLATE, EXCERPT))]


# A block fenced as ```text title="output"``` is what the page's code prints (all such
# blocks of a page, in order, are its whole output), word for word, with its numbers to
# `OUTPUT_RTOL`: float32 training runs differ in the last digits between JAX versions.
# Such a page runs in float32, as a reader runs it (the tests' conftest turns on x64).
OUTPUT = '```text title="output"'
OUTPUT_RTOL = 0.05
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d*)?(?:e[-+]?\d+)?$")


def _outputs(text: str) -> list[str]:
    return re.findall(rf"^{re.escape(OUTPUT)}\n(.*?)^```", text, re.S | re.M)


def _assert_same_output(printed: str, shown: str, page: str):
    got, want = printed.split(), shown.split()
    message = (
        f"docs/{page} shows output that its code does not print:\n{shown}\nprinted:\n{printed}"
    )
    assert len(got) == len(want), message
    for g, w in zip(got, want):
        if _NUMBER.match(w) and _NUMBER.match(g):
            assert abs(float(g) - float(w)) <= OUTPUT_RTOL * abs(float(w)), message
        else:
            assert g == w, message


def _pages() -> list[str]:
    """README.md and every docs page with Python code."""
    pages = ["../README.md"] + sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    return [page for page in pages if _python_blocks((DOCS / page).read_text())]


def _run(blocks: list[str], name: str):
    namespace: dict = {"__name__": "__docs__"}
    exec(compile("\n".join(blocks), name, "exec"), namespace)


# The guides whose code takes longest (9 to 19 s each on the 2-core machine, 2026-12-06)
# run in the slow tier, so that `make test` stays under 10 minutes (it took 559 and 644 s
# with them); CI runs them there.
_SLOW_PAGES = ("stiff.md", "ensembles.md", "neural_sde.md", "sparse.md", "milstein.md")
assert set(_SLOW_PAGES) <= set(_pages()), "a slow page is not among the pages with code"


@pytest.mark.parametrize(
    "page",
    [pytest.param(p, marks=pytest.mark.slow) if p in _SLOW_PAGES else p for p in _pages()],
)
def test_page_code_runs(page):
    """The page's Python blocks, in order, are one program, and it runs (and prints what
    its output blocks show)."""
    text = (DOCS / page).read_text()
    printed = io.StringIO()
    # A page that shows its output runs as a reader runs it: in JAX's default float32.
    precision = jax.enable_x64(False) if _outputs(text) else contextlib.nullcontext()
    with precision, contextlib.redirect_stdout(printed):
        _run(_runnable(_python_blocks(text)), f"docs/{page}")
    if _outputs(text):
        _assert_same_output(printed.getvalue(), "".join(_outputs(text)), page)


@pytest.mark.slow
@pytest.mark.parametrize("page", ["stiff.md", "sparse.md"])
def test_guide_runs_in_float32(page):
    """The stiff and sparse guides, which turn on x64, run without it too: in JAX's default
    float32 the root finders' and GMRES's tolerances are raised to what float32 resolves
    (the drift-implicit solvers' default 1e-8 ran out of steps)."""
    line = 'jax.config.update("jax_enable_x64", True)'
    text = (DOCS / page).read_text()
    blocks = _runnable(_python_blocks(text))
    assert line in "\n".join(blocks)  # the leg would test nothing otherwise
    with jax.enable_x64(False), contextlib.redirect_stdout(io.StringIO()):
        _run([b.replace(line, "") for b in blocks], f"docs/{page} in float32")


def test_output_blocks_are_compared():
    shown = "step  0  loss 11.2162\nstep 29  loss 0.0157\n"
    _assert_same_output("step  0  loss 11.2162\nstep 29  loss 0.0158\n", shown, "x.md")
    for wrong in ("step  0  loss 11.2162\n", "step  0  loss 11.2162\nstep 29  loss 0.02\n"):
        with pytest.raises(AssertionError, match="does not print"):
            _assert_same_output(wrong, shown, "x.md")
    assert _outputs((DOCS / "neural_sde.md").read_text())


def test_templates_are_marked():
    # The one template (the devdocs rule example) is marked and so not run.
    templates = [
        page
        for page in _pages()
        for block in _python_blocks((DOCS / page).read_text())
        if block.lstrip().startswith(TEMPLATE)
    ]
    assert templates == ["devdocs/structure_engine.md"]


def test_excerpts_are_lines_of_the_file_they_name():
    excerpts = []
    for page in _pages():
        for block in _python_blocks((DOCS / page).read_text()):
            head, _, body = block.lstrip().partition("\n")
            if not head.startswith(EXCERPT):
                continue
            path = ROOT / head.removeprefix(EXCERPT).split()[0].rstrip(":,")
            assert path.is_file(), f"docs/{page}: {head!r} names no file"
            source = {line.strip() for line in path.read_text().splitlines()}
            missing = [line for line in body.splitlines() if line.strip() not in source]
            assert not missing, f"docs/{page}: lines not in {path.name}: {missing}"
            excerpts.append(page)
    # The multi-host recipe, quoted from `examples/ensemble_multiprocess.py`.
    assert excerpts == ["ensembles.md", "ensembles.md"]


def _docstrings() -> dict[str, str]:
    docs = {}
    for module, prefix in ((dl, "diffrax_linearize"), (internal, "diffrax_linearize.internal")):
        for name in dir(module):
            obj = getattr(module, name)
            if name.startswith("_") or not (callable(obj) or isinstance(obj, type)):
                continue
            docs[f"{prefix}.{name}"] = inspect.cleandoc(obj.__doc__ or "")
            if isinstance(obj, type) and "__init__" in vars(obj):
                docs[f"{prefix}.{name}.__init__"] = inspect.cleandoc(obj.__init__.__doc__ or "")
    return docs


@pytest.mark.parametrize(
    "name", [name for name, doc in sorted(_docstrings().items()) if _python_blocks(doc)]
)
def test_docstring_code_runs(name):
    _run(_runnable(_python_blocks(_docstrings()[name])), name)


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
        # As the report joins them: a key a row lacks (an adaptive solve has no fixed `steps`)
        # counts as None. Each key must still appear in some row, so a misspelt one fails.
        for key in keys:
            assert any(key in row for row in data["rows"]), (path.name, key)
        cases = [tuple(row.get(k) for k in keys) for row in data["rows"]]
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
    assert "| problem | N | method | fastest (cpu-cpu) | fastest (gpu-nvidia-h200) |" in page
    assert "| A@x | 100 | ours | 2.00 ms | 40 µs |" in page
    assert "| A@x | 200 | ours | 250.00 ms | — |" in page
    # One machine only: no side-by-side table.
    (tmp_path / "materialise-gpu-nvidia-h200.json").unlink()
    assert "Side by side" not in report.render()


def test_readme_and_benchmarks_page_are_generated_from_the_json():
    # `python -m benchmarks.report` writes both: they must match the recorded results.
    from benchmarks import report

    assert report.update_readme(report.README.read_text()) == report.README.read_text(), (
        "README.md's measured table is stale: run `python -m benchmarks.report`"
    )
    assert report.render() == report.DOCS.read_text(), (
        "docs/benchmarks.md is stale: run `python -m benchmarks.report`"
    )


def test_noisy_work_precision_timings_are_flagged():
    from benchmarks.work_precision import noisy_points

    def rows(times):
        return [dict(m=50, method="x", steps=2**k, run_s=t) for k, t in enumerate(times, 2)]

    # Time per step constant, then one run twice as slow per step as the one before it.
    assert noisy_points(rows([4e-3, 8e-3, 16e-3, 64e-3])) == {(50, "x", 32): 2.0}
    assert noisy_points(rows([4e-3, 8e-3, 16e-3, 32e-3])) == {}


def test_readme_opens_with_the_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert lines[:2] == ["# diffrax_linearize", ""] and lines[2] == "```bash"
    assert lines[3].startswith("make demo") and lines[4].startswith("make test")
    assert "## Install" in (ROOT / "README.md").read_text()


def test_readme_counts_the_rules_there_are():
    (count,) = re.findall(r"(\d+) primitive rules", (ROOT / "README.md").read_text())
    assert int(count) == len(internal.registered_primitives())
