"""Check a built wheel as a package index would show it and a user would install it:

    python tests/check_wheel.py dist/diffrax_linearize-*.whl

`py.typed` is in it, its metadata has a summary, project URLs, classifiers and a long
description that does not open with the clone's `make` commands. (`make check-wheel` then
installs the wheel into a fresh virtual environment and imports it.) Not a pytest file: it
needs a built wheel.
"""

import email.parser
import sys
import zipfile


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
    if not metadata.get_all("Project-URL"):
        problems.append("no Project-URL")
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
    return problems


if __name__ == "__main__":
    (wheel_path,) = sys.argv[1:]
    problems = check(wheel_path)
    for problem in problems:
        print(f"{wheel_path}: {problem}", file=sys.stderr)
    if problems:
        sys.exit(1)
    print(f"{wheel_path}: py.typed, metadata and long description OK")
