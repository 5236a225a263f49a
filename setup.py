"""Only the long description: README.md for a package index. Left out: its first section
(the two `make` commands for a clone of the repository, before the first `---` line), the
blocks between `<!-- developer -->` and `<!-- /developer -->` (working on the library),
and the HTML comments that mark generated tables (their content stays)."""

import pathlib
import re

import setuptools


readme = (pathlib.Path(__file__).parent / "README.md").read_text(encoding="utf-8")
title, _, body = readme.partition("\n---\n")
assert body, "README.md: the long description starts after its first `---` line"
body = re.sub(r"<!-- developer -->.*?<!-- /developer -->", "", body, flags=re.S)
assert "developer -->" not in body, "README.md: unbalanced `<!-- developer -->` markers"
body = re.sub(r"<!--.*?-->", "", body, flags=re.S)
body = re.sub(r"\n{3,}", "\n\n", body).strip() + "\n"
setuptools.setup(
    long_description=title.splitlines()[0] + "\n\n" + body,
    long_description_content_type="text/markdown",
)
