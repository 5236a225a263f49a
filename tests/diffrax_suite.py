"""Diffrax 0.7.2's own tests, run with this project's classes in place of Diffrax's.

`make test-diffrax` (or `python tests/diffrax_suite.py [pytest arguments]`) runs Diffrax's
`test_integrate.py::test_sde_strong_order`, `test_adjoint.py` and `test_saveat_solution.py`
with `diffrax.ItoMilstein`, `diffrax.StratonovichMilstein` and `diffrax.BacksolveAdjoint`
replaced by `diffrax_linearize.ItoMilstein`, `.StratonovichMilstein` and
`.BacksolveAdjoint`. Not part of the default suite: it takes the better part of an hour
on two cores. The result is recorded in `docs/devdocs/diffrax_tests.md`.

This file is both the driver and the pytest plugin that makes the substitution. The
tests use attribute access (`diffrax.BacksolveAdjoint()`) and build their solver lists at
collection, so replacing the attributes in `pytest_configure`, before collection, puts
our classes everywhere Diffrax's test code names them (Diffrax's internals keep their own).

Diffrax's tests are not in this repository, and not in the PyPI sdist of diffrax 0.7.2
either (it holds the package alone). They come from Diffrax's git repository, from the
first of:

- `DIFFRAX_TESTS=/path/to/test`: a directory holding Diffrax 0.7.2's `test/` files;
- `DIFFRAX_GIT=/path/to/diffrax`: a clone (or bare git directory) of Diffrax with the tag
  `v0.7.2`, from which `test/` is read with `git archive`;
- otherwise `git clone --depth 1 --branch v0.7.2` from GitHub into `.diffrax-tests/`.

Whatever the source, every file used is checked against its git blob hash at `v0.7.2`, so
the tests run are exactly Diffrax's. `DIFFRAX_SUITE_PLAIN=1` runs the same selection with
Diffrax's own classes, as a baseline.
"""

import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile


TAG = "v0.7.2"
REPO = "https://github.com/patrick-kidger/diffrax"
SUBSTITUTED = ("ItoMilstein", "StratonovichMilstein", "BacksolveAdjoint")

# `git rev-parse v0.7.2:test/<file>` in Diffrax's repository.
BLOBS = {
    "__init__.py": "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391",
    "conftest.py": "532dcf921e3d9ded008bc10d792ed7825cde26c0",
    "helpers.py": "97b0f0749bbf709dd4ff50504330be1bebc6feaf",
    "test_integrate.py": "fcf3a83602025c10791678762142179765c6a4c0",
    "test_adjoint.py": "9e17e5354efd40acf3841798cd1be7f68010b741",
    "test_saveat_solution.py": "7b8b9dfcf18d4813e2bb81ce5c9d4e182531ece9",
}

SELECTION = [
    "test/test_integrate.py::test_sde_strong_order",
    "test/test_adjoint.py",
    "test/test_saveat_solution.py",
]
# Fails with Diffrax's own classes too on jax 0.10.2 (a dtype promotion inside Diffrax's
# implicit solver under the tests' strict promotion), and uses none of ours.
DESELECTED = ["test/test_adjoint.py::test_implicit"]

ROOT = pathlib.Path(__file__).resolve().parent.parent


# ---- the pytest plugin


def pytest_configure(config):
    if os.environ.get("DIFFRAX_SUITE_PLAIN"):
        return
    import diffrax
    import diffrax_linearize

    for name in SUBSTITUTED:
        setattr(diffrax, name, getattr(diffrax_linearize, name))


def pytest_report_header(config):
    if os.environ.get("DIFFRAX_SUITE_PLAIN"):
        return f"Diffrax {TAG}'s tests with Diffrax's own classes (baseline)"
    names = ", ".join(f"diffrax.{n}" for n in SUBSTITUTED)
    return f"Diffrax {TAG}'s tests with diffrax_linearize's classes as {names}"


# ---- the driver


def _blob_hash(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _fetch(dest: pathlib.Path) -> None:
    """Diffrax's `test/` files into `dest`, from the first source that is given."""
    if "DIFFRAX_TESTS" in os.environ:
        source = pathlib.Path(os.environ["DIFFRAX_TESTS"])
        for name in BLOBS:
            shutil.copy(source / name, dest / name)
        return
    if "DIFFRAX_GIT" in os.environ:
        git_dir = pathlib.Path(os.environ["DIFFRAX_GIT"])
    else:
        git_dir = ROOT / ".diffrax-tests"
        if not git_dir.exists():
            clone = ["git", "clone", "-q", "--depth", "1", "--branch", TAG, REPO, str(git_dir)]
            if subprocess.run(clone).returncode != 0:
                sys.exit(
                    f"Could not clone {REPO} at {TAG}. Diffrax's tests are not on PyPI (the "
                    "sdist holds the package alone): pass a clone with DIFFRAX_GIT=... or "
                    "the test folder with DIFFRAX_TESTS=..."
                )
    for name in BLOBS:
        data = subprocess.run(
            ["git", f"--git-dir={_git_dir(git_dir)}", "show", f"{TAG}:test/{name}"],
            capture_output=True,
            check=True,
        ).stdout
        (dest / name).write_bytes(data)


def _git_dir(path: pathlib.Path) -> pathlib.Path:
    return path / ".git" if (path / ".git").exists() else path


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="diffrax-suite-") as tmp:
        tests = pathlib.Path(tmp) / "test"
        tests.mkdir()
        _fetch(tests)
        for name, blob in BLOBS.items():
            actual = _blob_hash((tests / name).read_bytes())
            if actual != blob:
                sys.exit(f"test/{name} is not Diffrax {TAG}'s (git blob {actual}, not {blob}).")
        # Our own pytest configuration (`-m 'not slow'`, `testpaths`) must not apply.
        (pathlib.Path(tmp) / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow\n")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]))
        command = [sys.executable, "-m", "pytest", "-p", "diffrax_suite", "-p", "no:cacheprovider"]
        command += [f"--deselect={d}" for d in DESELECTED] + SELECTION + argv
        print("+", " ".join(command), flush=True)
        return subprocess.run(command, cwd=tmp, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
