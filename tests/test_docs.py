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
