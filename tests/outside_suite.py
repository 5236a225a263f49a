"""What the drivers of the outside test suites share: a library's test files at a release
tag, read from a git repository and checked against their git blob hashes (`fetch`, for
`diffrax_suite.py`, `lineax_suite.py` and `optimistix_suite.py`), then run by pytest in a
temporary folder with the suite's module as a plugin (`run`, for the latter two), whose
collection keeps the cases of ours and marks the known failures (`select`)."""

import hashlib
import importlib.metadata
import os
import pathlib
import subprocess
import sys
import tempfile


ROOT = pathlib.Path(__file__).resolve().parent.parent


def _blob_hash(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def fetch(
    dest: pathlib.Path, package: str, repo: str, tag: str, blobs: dict, folder: str = "tests"
) -> None:
    """`blobs`' files of the test folder (`folder`) of `package` at `tag` into `dest`, from
    the first source given: `<PACKAGE>_TESTS` (a folder of those files), `<PACKAGE>_GIT` (a
    clone or bare git directory with the tag), or a shallow clone of `repo` into
    `.<package>-tests/`; then each file checked against its git blob hash in `blobs`."""
    prefix = package.upper()
    if f"{prefix}_TESTS" in os.environ:
        source = pathlib.Path(os.environ[f"{prefix}_TESTS"])
        for name in blobs:
            (dest / name).write_bytes((source / name).read_bytes())
        _check(dest, package, tag, blobs, folder)
        return
    if f"{prefix}_GIT" in os.environ:
        git_dir = pathlib.Path(os.environ[f"{prefix}_GIT"])
    else:
        git_dir = ROOT / f".{package}-tests"
        if not git_dir.exists():
            clone = ["git", "clone", "-q", "--depth", "1", "--branch", tag, repo, str(git_dir)]
            if subprocess.run(clone).returncode != 0:
                sys.exit(
                    f"Could not clone {repo} at {tag}. The tests of {package} are not on PyPI "
                    f"(its sdist holds the package alone): pass a clone with {prefix}_GIT=... "
                    f"or the test folder with {prefix}_TESTS=..."
                )
    if (git_dir / ".git").exists():
        git_dir = git_dir / ".git"
    for name in blobs:
        data = subprocess.run(
            ["git", f"--git-dir={git_dir}", "show", f"{tag}:{folder}/{name}"],
            capture_output=True,
            check=True,
        ).stdout
        (dest / name).write_bytes(data)
    _check(dest, package, tag, blobs, folder)


def _check(dest: pathlib.Path, package: str, tag: str, blobs: dict, folder: str) -> None:
    for name, blob in blobs.items():
        actual = _blob_hash((dest / name).read_bytes())
        if actual != blob:
            sys.exit(f"{folder}/{name} is not {package} {tag}'s (git blob {actual}, not {blob}).")


def require_jax(tag: str, what: str) -> None:
    """Exit, saying so, unless the installed jax is the release of `tag` (`jax-vX.Y.Z`),
    whose tests `what` reads."""
    installed = importlib.metadata.version("jax")
    if f"jax-v{installed}" != tag:
        sys.exit(
            f"{what} need jax {tag[5:]} installed, not {installed} (`constraints.txt` pins it)."
        )


def run(plugin: str, package: str, repo: str, tag: str, blobs: dict, argv: list[str]) -> int:
    """`pytest -p plugin` on the test files of `blobs`, read as `fetch` says and checked
    against their blob hashes, with `argv` appended; the installed `package` must be the
    release of `tag`."""
    installed = importlib.metadata.version(package)
    if f"v{installed}" != tag:
        sys.exit(
            f"The tests of {package} {tag} need {package} {tag[1:]} installed, not "
            f"{installed} (`constraints.txt` pins it; `make test-{package}` installs it)."
        )
    with tempfile.TemporaryDirectory(prefix=f"{package}-suite-") as tmp:
        tests = pathlib.Path(tmp) / "tests"
        tests.mkdir()
        fetch(tests, package, repo, tag, blobs)
        # Our own pytest configuration (`-m 'not slow'`, `testpaths`) must not apply.
        (pathlib.Path(tmp) / "pytest.ini").write_text("[pytest]\n")
        env = dict(os.environ)
        # The temporary folder first, so that `tests` is the library's package, not ours.
        env["PYTHONPATH"] = os.pathsep.join([tmp, str(ROOT / "tests"), str(ROOT)])
        selection = [f"tests/{name}" for name in blobs if name.startswith("test_")]
        command = [sys.executable, "-m", "pytest", "-p", plugin, "-p", "no:cacheprovider"]
        command += selection + argv
        print("+", " ".join(command), flush=True)
        return subprocess.run(command, cwd=tmp, env=env).returncode


def select(config, items, keep, known_failures=None) -> None:
    """Keeps the collected `items` for which `keep(item)` holds, reporting the others to
    pytest as deselected, and marks each kept one of `known_failures` (node id ->
    `(reason, exception)`) `xfail(strict=True, raises=exception)`: the run then fails if it
    passes (the record is out of date) or fails otherwise."""
    import pytest

    kept = [item for item in items if keep(item)]
    for item in kept:
        if item.nodeid in (known_failures or {}):
            reason, raises = known_failures[item.nodeid]
            item.add_marker(pytest.mark.xfail(strict=True, reason=reason, raises=raises))
    if len(kept) < len(items):
        kept_ids = {id(item) for item in kept}
        config.hook.pytest_deselected(items=[i for i in items if id(i) not in kept_ids])
        items[:] = kept
