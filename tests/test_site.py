"""The built documentation site, as a reader gets it: every public name renders with a
description and its options, no page loads anything from the network, and (in a real
headless browser) the maths is typeset by the MathJax shipped with the site.

The site is built once per session into a temporary folder (a few seconds), or taken from
`$DOCS_SITE` when `make docs` has just built it. Needs the docs extras
(`pip install -e '.[docs]'`, which `make docs` does); skipped without them.
"""

import contextlib
import functools
import html
import html.parser
import http.server
import inspect
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading

import diffrax_linearize as dl
import diffrax_linearize.internal as internal
import pytest


ROOT = pathlib.Path(__file__).parent.parent
# A maths-heavy page for the browser check: the solvers' step formulas and integrals.
MATHS_PAGE = "api/solvers"

pytest.importorskip("mkdocs", reason="the docs extras are not installed (`make docs` has them)")


@pytest.fixture(scope="session")
def site(tmp_path_factory) -> pathlib.Path:
    if os.environ.get("DOCS_SITE"):
        return pathlib.Path(os.environ["DOCS_SITE"])
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(out)]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    return out


#
# A small HTML tree, enough to find an API entry and the text under it.
#


class _Node:
    def __init__(self, tag: str, attrs: dict):
        self.tag, self.attrs, self.children = tag, attrs, []

    def classes(self) -> set[str]:
        return set((self.attrs.get("class") or "").split())

    def text(self, skip=lambda node: False) -> str:
        parts = []
        for child in self.children:
            if isinstance(child, str):
                parts.append(child)
            elif not skip(child):
                parts.append(child.text(skip))
        return "".join(parts)

    def walk(self):
        yield self
        for child in self.children:
            if isinstance(child, _Node):
                yield from child.walk()


_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source"}


class _TreeBuilder(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.root = _Node("root", {})
        self.stack = [self.root]

    def handle_starttag(self, tag, attrs):
        node = _Node(tag, dict(attrs))
        self.stack[-1].children.append(node)
        if tag not in _VOID:
            self.stack.append(node)

    def handle_endtag(self, tag):
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data):
        self.stack[-1].children.append(data)


@functools.cache
def _parse(path: pathlib.Path) -> _Node:
    builder = _TreeBuilder()
    builder.feed(path.read_text())
    return builder.root


def _api_entries(site: pathlib.Path) -> dict[str, _Node]:
    """Each rendered API object (`<div class="doc doc-object">`) by its anchor."""
    entries = {}
    for page in (site / "api").rglob("index.html"):
        for node in _parse(page).walk():
            if "doc-object" not in node.classes():
                continue
            heading = next(c for c in node.children if isinstance(c, _Node) and "id" in c.attrs)
            entries[heading.attrs["id"]] = node
    return entries


def _public_names() -> dict[str, object]:
    names = {}
    for module, prefix in ((dl, "diffrax_linearize"), (internal, "diffrax_linearize.internal")):
        for name in dir(module):
            obj = getattr(module, name)
            if not name.startswith("_") and not inspect.ismodule(obj):
                names[f"{prefix}.{name}"] = obj
    names["diffrax_linearize.internal"] = internal
    return names


def _is_nested_entry(node: _Node) -> bool:
    return "doc-object" in node.classes()


def _is_heading_or_bases(node: _Node) -> bool:
    return "doc-heading" in node.classes() or "doc-class-bases" in node.classes()


def _options(obj) -> list[str]:
    """The names a user passes: a function's parameters, a class's constructor's."""
    if inspect.ismodule(obj) or not callable(obj):
        return []
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return []
    return [
        p.name
        for p in signature.parameters.values()
        if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]


def _code_words(node: _Node) -> set[str]:
    """The words in inline code of the rendered docstrings (not in the signatures)."""
    words = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if "doc-heading" in n.classes():
            continue
        if n.tag == "code":
            words |= set(re.findall(r"\w+", n.text()))
        stack.extend(c for c in n.children if isinstance(c, _Node))
    return words


def _has_arguments_section(node: _Node) -> bool:
    return any(
        n.tag == "strong" and n.text().strip() in ("Arguments:", "Fields:") for n in node.walk()
    )


# Internal extension hooks whose options are not described yet. The structure engine that
# defines them is being rewritten; its new docstrings take them off this list.
_OPTIONS_PENDING = {"diffrax_linearize.internal.Struct"}


def test_every_public_name_renders_with_a_description_and_its_options(site):
    entries = _api_entries(site)
    problems = []
    assert _OPTIONS_PENDING <= set(_public_names()), "remove names that no longer exist"
    for name, obj in sorted(_public_names().items()):
        entry = entries.get(name)
        if entry is None:
            problems.append(f"{name}: no API entry with this anchor in the built site")
            continue
        # The object's own text: not its heading, its bases, or its members' entries.
        own = entry.text(skip=lambda n: _is_nested_entry(n) or _is_heading_or_bases(n))
        if len(re.findall(r"[A-Za-z]{2,}", own)) < 5:
            problems.append(f"{name}: renders without a description")
        # Its options, by name, in its docstring or its rendered `__init__`'s; a class's in
        # an **Arguments:** section, as Diffrax renders each solver's `__init__`.
        options = [] if name in _OPTIONS_PENDING else _options(obj)
        missing = [o for o in options if o not in _code_words(entry)]
        if missing:
            problems.append(f"{name}: options rendered without a description: {missing}")
        if inspect.isclass(obj) and options and not _has_arguments_section(entry):
            problems.append(f"{name}: no **Arguments:** section for its options {options}")
    assert not problems, "\n".join(problems)


def test_no_private_names_in_the_api_reference(site):
    for anchor in _api_entries(site):
        parts = anchor.split(".")
        private = [p for p in parts if p.startswith("_") and not p.startswith("__")]
        assert not private, f"private name in the API reference: {anchor}"


def test_no_private_base_classes(site):
    # A private base (a mixin) has no page to link to: `docs/_scripts/public_bases.py`
    # leaves it out of the "Bases:" line.
    for name, entry in _api_entries(site).items():
        for node in entry.walk():
            if "doc-class-bases" in node.classes():
                paths = [n.attrs.get("title", "") for n in node.walk()]
                private = [p for p in paths if p.startswith("diffrax_linearize._")]
                assert not private, f"{name} shows a private base: {private}"


def test_pages_load_nothing_from_the_network(site):
    for page in site.rglob("*.html"):
        text = page.read_text()
        remote = re.findall(r'<(?:script|link)[^>]+(?:src|href)="(https?://[^"]+)"', text)
        assert not remote, f"{page.relative_to(site)} loads {remote}"


def test_mathjax_is_shipped_with_the_site(site):
    page = (site / "milstein" / "index.html").read_text()
    (script,) = re.findall(r'<script src="([^"]*tex-mml-chtml\.js)"', page)
    assert (site / "milstein" / script).resolve().is_file()


#
# The benchmarks page: one plot per benchmark, short tables.
#

BENCHMARKS_PAGE = "benchmarks"


def _sections(page: _Node) -> dict[str, list[_Node]]:
    """The nodes under each `<h2>` of a page's article, by the heading's text."""
    (article,) = [n for n in page.walk() if n.tag == "article"]
    sections: dict[str, list[_Node]] = {}
    current = None
    for child in article.children:
        if isinstance(child, _Node) and child.tag == "h2":
            current = sections.setdefault(child.text().strip("¶ \n"), [])
        elif isinstance(child, _Node) and current is not None:
            current.append(child)
    return sections


def _recorded_benchmarks() -> set[str]:
    import json

    results = ROOT / "benchmarks" / "results"
    return {json.loads(p.read_text())["benchmark"] for p in results.glob("*.json")}


def test_benchmarks_page_has_a_plot_per_benchmark(site):
    path = site / BENCHMARKS_PAGE / "index.html"
    sections = _sections(_parse(path))
    assert len(sections) == len(_recorded_benchmarks()), sorted(sections)
    for title, nodes in sections.items():
        images = [n for node in nodes for n in node.walk() if n.tag == "img"]
        assert images, f"the benchmarks page's section {title!r} has no plot"
        for image in images:
            src = image.attrs["src"]
            assert (path.parent / src).resolve().is_file(), f"{title!r}: {src} is not in the site"
            assert image.attrs.get("alt"), f"{title!r}: {src} has no alt text"
        links = [n.attrs.get("href", "") for node in nodes for n in node.walk() if n.tag == "a"]
        data = [h for h in links if h.endswith(".json")]
        assert data, f"{title!r} does not link its full data"
        assert all((path.parent / h).resolve().is_file() for h in data), data


def test_benchmarks_page_tables_are_short(site):
    for table in (
        n for n in _parse(site / BENCHMARKS_PAGE / "index.html").walk() if n.tag == "table"
    ):
        headings = [n.text().strip() for n in table.walk() if n.tag == "th"]
        assert len(headings) <= 8, f"a table of {len(headings)} columns: {headings}"
        raw = [h for h in headings if re.search(r"_(s|MiB|ratio)$|^run_|_vs_", h)]
        assert not raw, f"raw JSON keys as column headings: {raw}"


#
# A real browser: the maths of a maths-heavy page is typeset, offline.
#


def _browser() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        if found := shutil.which(name):
            return found
    return None


class _Handler(http.server.SimpleHTTPRequestHandler):
    # A script to add to the page at a path, for the check to read its result in the DOM.
    inject: dict[str, str] = {}

    def do_GET(self):
        script = self.inject.get(self.path)
        if script is None:
            return super().do_GET()
        page = (pathlib.Path(self.directory) / self.path.strip("/") / "index.html").read_text()
        body = page.replace("</body>", f"<script>{script}</script></body>").encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@contextlib.contextmanager
def _serve(root: pathlib.Path, inject: dict[str, str] | None = None):
    """The site over HTTP on the loopback interface (MathJax loads its fonts with
    requests that `file://` pages may not make), with `inject`'s scripts added to pages."""
    handler = functools.partial(
        type("Handler", (_Handler,), {"inject": inject or {}}), directory=str(root)
    )

    class Quiet(http.server.ThreadingHTTPServer):
        def handle_error(self, request, client_address):
            pass

    handler.log_message = lambda *args: None  # pyright: ignore
    with Quiet(("127.0.0.1", 0), handler) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}"
        finally:
            server.shutdown()


def _chromium(browser: str, url: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        # Offline: every host but the local server fails to resolve.
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
        "--virtual-time-budget=20000",
        "--window-size=1200,1600",
        *extra,
        url,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _require_browser() -> str:
    browser = _browser()
    if browser is None:
        why = (
            "no Chromium found: install Debian's `chromium` (`apt-get install chromium`; "
            "`.ci/run` does when it runs as root) to check the site in a real browser"
        )
        if os.environ.get("DOCS_REQUIRE_BROWSER"):  # as `.ci/run` sets it
            pytest.fail(f"{why} (DOCS_REQUIRE_BROWSER is set)")
        pytest.skip(why)
    return browser


@pytest.mark.browser
def test_maths_renders_offline_in_a_headless_browser(site, tmp_path):
    browser = _require_browser()
    screenshot = pathlib.Path(os.environ.get("DOCS_SCREENSHOT", tmp_path / "maths.png"))
    with _serve(site) as url:
        dom = _chromium(browser, f"{url}/{MATHS_PAGE}/", "--dump-dom")
        shot = _chromium(browser, f"{url}/{MATHS_PAGE}/", f"--screenshot={screenshot}")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert shot.returncode == 0 and screenshot.is_file(), shot.stderr[-2000:]
    typeset = dom.stdout.count("<mjx-container")
    raw = re.findall(r"\\\(|\\\[", html.unescape(re.sub(r"<script.*?</script>", "", dom.stdout)))
    assert typeset >= 5, f"MathJax typeset {typeset} formulas on {MATHS_PAGE}"
    assert not raw, f"{len(raw)} formulas left as raw LaTeX on {MATHS_PAGE}"


# After the page has loaded, each image's decoded width, where the DOM dump shows it.
_IMAGE_WIDTHS = (
    "window.addEventListener('load', () => document.querySelectorAll('article img')"
    ".forEach(i => i.setAttribute('data-loaded-width', i.complete ? i.naturalWidth : 0)));"
)


@pytest.mark.browser
def test_benchmark_plots_load_in_a_headless_browser(site):
    browser = _require_browser()
    path = f"/{BENCHMARKS_PAGE}/"
    with _serve(site, inject={path: _IMAGE_WIDTHS}) as url:
        dom = _chromium(browser, url + path, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    images = re.findall(r"<img[^>]*>", dom.stdout)
    # No width recorded: the page's load event never fired (an image still loading).
    widths = {
        re.search(r'src="([^"]*)"', i)[1]: int(m[1] if m else 0)
        for i in images
        for m in [re.search(r'data-loaded-width="(\d+)"', i)]
    }
    assert len(widths) >= len(_recorded_benchmarks()), widths
    broken = [src for src, width in widths.items() if width == 0]
    assert not broken, f"plots that did not load on the benchmarks page: {broken}"
