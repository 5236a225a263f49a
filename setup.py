"""Only the long description: README.md after its first section. That section is the two
`make` commands for a clone of the repository, which are not for a package index."""

import pathlib

import setuptools


readme = (pathlib.Path(__file__).parent / "README.md").read_text(encoding="utf-8")
title, _, body = readme.partition("\n---\n")
assert body, "README.md: the long description starts after its first `---` line"
setuptools.setup(
    long_description=title.splitlines()[0] + "\n\n" + body.lstrip(),
    long_description_content_type="text/markdown",
)
