"""The package's private modules import each other in one direction (issue 24, item 5):
the storage algebra below (`_structure`: blocks and their plain forms; `_sparsity`:
row-compressed patterns and how operators store them), the interpreter and its rules
above, the public APIs on top. Read from the sources, function-level imports included."""

import ast
import pathlib

import diffrax_linearize


PACKAGE = pathlib.Path(diffrax_linearize.__file__).parent


def _imports() -> dict[str, set[str]]:
    graph = {}
    for path in sorted(PACKAGE.glob("_*.py")):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    deps.add(node.module.split(".")[0])
                else:
                    deps |= {a.name for a in node.names}
        graph[path.stem] = deps - {path.stem}
    return graph


def test_no_import_cycles():
    graph = _imports()
    done, path = set(), []

    def visit(m):
        if m in path:
            raise AssertionError(f"import cycle: {' -> '.join(path[path.index(m) :] + [m])}")
        if m in done or m not in graph:
            return
        path.append(m)
        for d in sorted(graph[m]):
            visit(d)
        path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)


def test_storage_algebra_at_the_bottom():
    graph = _imports()
    assert graph["_structure"] <= {"_compat"}, graph["_structure"]
    # Shared type aliases and dtype helpers, beneath everything.
    assert not graph["_custom_types"], graph["_custom_types"]
    assert graph["_sparsity"] <= {"_compat", "_custom_types", "_structure"}, graph["_sparsity"]
    for engine in ("_interpreter", "_rules", "_loops", "_colouring"):
        assert not graph[engine] & {"_materialise", "_operators", "_term"}, (engine, graph[engine])
