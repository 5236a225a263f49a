"""Check a built wheel as a package index would show it and a user would install it:

    python tests/check_wheel.py dist/diffrax_linearize-*.whl

`py.typed` is in it; its metadata has a summary, classifiers, every package the library
imports as a dependency, no project URL (all shown as this project's) that points elsewhere,
and a long description for users: no `make` targets, no HTML comments (the README's
markers), no relative links (which a package index cannot follow). (`make check-wheel`
then installs the wheel into a fresh virtual environment and imports it.) Not a pytest
file: it needs a built wheel.
"""

import ast
import email.parser
import pathlib
import re
import sys
import zipfile


ROOT = pathlib.Path(__file__).parent.parent


def _imported() -> set[str]:
    """The third-party packages that the package's own modules import (their import names
    are their distribution names)."""
    names = set()
    for path in (ROOT / "diffrax_linearize").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names} - {"diffrax_linearize"}


def _make_targets() -> list[str]:
    (phony,) = re.findall(r"^\.PHONY:(.*)$", (ROOT / "Makefile").read_text(), re.M)
    return phony.split()


def _url_problems(metadata) -> list[str]:
    # A package index lists every project URL as the project's own links, whatever its
    # label: each must be an address of this project (there are none until it is
    # published; related projects are linked from the long description's text).
    urls = [u.split(",", 1) for u in metadata.get_all("Project-URL") or []]
    if metadata.get("Home-page"):
        urls.append(["Home-page", metadata["Home-page"]])
    return [
        f"Project-URL {label!r} is shown as this project's but is {url.strip()}"
        for label, url in urls
        if not re.search(r"diffrax[-_]linearize", url, re.I)
    ]


def check(path: str) -> list[str]:
    with zipfile.ZipFile(path) as wheel:
        names = wheel.namelist()
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = email.parser.Parser().parsestr(wheel.read(metadata_name).decode())
    problems = []
    if "diffrax_linearize/py.typed" not in names:
        problems.append("no diffrax_linearize/py.typed")
    if not any(n.startswith("diffrax_linearize/_solver/") for n in names):
        problems.append("the _solver subpackage is missing")
    for field in ("Summary", "Requires-Python", "License-Expression"):
        if not metadata.get(field):
            problems.append(f"no {field}")
    problems += _url_problems(metadata)
    requires = [re.split(r"[\s<>=!~;\[(]", r, maxsplit=1)[0].lower() for r in
                metadata.get_all("Requires-Dist") or []]  # fmt: skip
    for name in sorted(_imported()):
        if name not in requires:
            problems.append(f"{name} is imported by the package but not a dependency")
    classifiers = metadata.get_all("Classifier") or []
    if "Typing :: Typed" not in classifiers:
        problems.append(f"classifiers lack 'Typing :: Typed': {classifiers}")
    description = metadata.get_payload().strip()
    if metadata.get("Description-Content-Type") != "text/markdown":
        problems.append("the long description is not marked as Markdown")
    if not description.startswith("# diffrax_linearize") or "make demo" in description[:400]:
        problems.append(f"the long description opens with {description[:120]!r}")
    if "## Install" not in description:
        problems.append("the long description has no Install section")
    if "<!--" in description or "-->" in description:
        problems.append("the long description holds HTML comments (the README's markers)")
    for target in _make_targets():
        if re.search(rf"\bmake {re.escape(target)}\b", description):
            problems.append(f"the long description mentions `make {target}`")
    for link in re.findall(r"\]\(([^)\s]+)", description):
        if not re.match(r"https?://", link):
            problems.append(f"the long description has a relative link {link!r}")
    return problems


if __name__ == "__main__":
    (wheel_path,) = sys.argv[1:]
    problems = check(wheel_path)
    for problem in problems:
        print(f"{wheel_path}: {problem}", file=sys.stderr)
    if problems:
        sys.exit(1)
    print(f"{wheel_path}: py.typed, metadata and long description OK")
