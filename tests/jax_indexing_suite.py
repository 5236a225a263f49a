"""JAX 0.10.2's own indexing catalogue, run through `materialise` and `materialise_operator`
against `jax.jacfwd` and `jax.jacrev`.

`make test-jax-indexing` (or `python tests/jax_indexing_suite.py [pytest arguments]`)
reads the index expressions of JAX's `tests/lax_numpy_indexing_test.py` (its
`IndexSpec` catalogues: basic slices, integers, `None` and `Ellipsis`, out-of-bounds
integers, `jax.ds`, integer arrays with and without repeats, mixed basic and advanced
indexing, and its `UpdateOps`, the eight `.at[]` updates) and checks the Jacobian of each
expression, as JAX's own tests use them:

- `take`: `x[indexer]` (JAX's default strategy), `indexing.rewriting_take(x, indexer,
  strategy, mode)` for each of JAX's indexing strategies (static slice, dynamic slice,
  gather, scatter) and modes (JAX's `IndexingStrategyTest`), and `x.at[indexer].get(mode,
  fill_value=7)` for each of `MODES` (`testStaticIndexingGrads`);
- `traced`: the integer and integer-array indexers passed as traced arguments of a
  `jax.jit`, so that the index is not known when the Jacobian is taken (a data-dependent
  gather or dynamic slice; `testDynamicIndexingWithIntegers` and its grads test);
- `update`: `x.at[indexer].<op>(y)` for every `UpdateOps` on the cases JAX differentiates
  (`testStaticIndexingGrads` over its modes, `testAdvancedIndexingGrads` with and without
  repeated indices) and, for `min`, `max`, `divide` and `power`, on the cases whose values
  JAX tests (`testStaticIndexing`, `testAdvancedIndexing`, `testMixedAdvancedIndexing`),
  with respect to both `x` and `y`;
- `segment`: `jax.ops.segment_sum`, `segment_prod`, `segment_min` and `segment_max` with
  the parameters of JAX's `testSegmentReduce` (restated: they are written in its
  decorator), segment ids drawn as it draws them (integers in [-2, 3), so some are out of
  range), known and traced. Without `num_segments` the number of segments is read from
  the ids as a Python number, which `jax.jit` refuses, and so do ours (they trace as
  `jax.jit` does): there the check is that ours raise JAX's error with the note that says
  to pass `num_segments=`.

Each case checks, in one dtype (float64 and float32 by turns; `--all` runs both):
`materialise` eager with its automatic mode against `jax.jacfwd`; under `jax.jit`,
`mode="forward"` against `jax.jacfwd` and `mode="reverse"` against `jax.jacrev`; and
`materialise_operator` for each argument, as a matrix, against `jax.jacfwd`
(`helpers.assert_jacobian_equal`: bit for bit for the zero-one Jacobians of pure data
movement). Where JAX's two modes disagree with each other (an out-of-bounds index under
`mode="promise_in_bounds"`, which JAX leaves undefined: the gather clamps, its transpose
drops), each of ours (both modes, the automatic one, the operators) must be one of JAX's
two answers.

The default run takes a deterministic sample of the product (every case of `take`,
`traced` and `segment`, a seventh of `update`); `--all` takes everything. JAX's tests are not in the
jax wheel, and come from JAX's git repository, the first of `JAX_TESTS=/path/to/tests`,
`JAX_GIT=/path/to/jax` (a clone or bare git directory with the tag `jax-v0.10.2`), or a
shallow clone from GitHub into `.jax-tests/`; the file is checked against its git blob
hash (`outside_suite.py`). The result is recorded in `docs/devdocs/structure_engine.md`.
"""

import importlib.util
import itertools
import os
import pathlib
import subprocess
import sys
import tempfile


TAG = "jax-v0.10.2"
REPO = "https://github.com/jax-ml/jax"
FILE = "lax_numpy_indexing_test.py"
# `git rev-parse jax-v0.10.2:tests/lax_numpy_indexing_test.py` in JAX's repository.
BLOBS = {FILE: "51dacdd00d0f2a11a26d5c0dafad83f447d260ef"}
_ENV = "DL_JAX_INDEXING_TEST"


def main(argv) -> int:
    from outside_suite import fetch, require_jax, ROOT

    require_jax(TAG, f"JAX {TAG[5:]}'s indexing tests")
    with tempfile.TemporaryDirectory(prefix="jax-indexing-suite-") as tmp:
        fetch(pathlib.Path(tmp), "jax", REPO, TAG, BLOBS)
        env = dict(os.environ, **{_ENV: str(pathlib.Path(tmp) / FILE)})
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", __file__]
        command += ["-m", "sweep or not sweep" if "--all" in argv else "not sweep"]
        command += [a for a in argv if a != "--all"]
        print("+", " ".join(command), flush=True)
        return subprocess.run(command, cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    sys.exit(main(sys.argv[1:]))


# ---- the pytest module (collected only with `DL_JAX_INDEXING_TEST` set) -----------------

import diffrax_linearize as dl  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from helpers import assert_jacobian_equal  # noqa: E402


def _load():
    path = os.environ.get(_ENV)
    if path is None:
        pytest.skip(
            "JAX's indexing catalogue is read by `python tests/jax_indexing_suite.py`",
            allow_module_level=True,
        )
    spec = importlib.util.spec_from_file_location("jax_lax_numpy_indexing_test", path)
    module = importlib.util.module_from_spec(spec)
    argv, sys.argv = sys.argv, sys.argv[:1]  # absl parses flags when the file is loaded
    try:
        spec.loader.exec_module(module)
    finally:
        sys.argv = argv
    return module


J = _load()
U = J.UpdateOps
_STRATEGIES = list(J.indexing.IndexingStrategy)
_VALUES = (
    "STATIC_INDEXING_TESTS",
    "ADVANCED_INDEXING_TESTS_NO_REPEATS",
    "ADVANCED_INDEXING_TESTS_NO_REPEATS_SORTED",
    "MIXED_ADVANCED_INDEXING_TESTS_NO_REPEATS",
)


def _specs(*catalogues):
    """`(id, IndexSpec)` of each spec of the named catalogues of JAX's module."""
    for catalogue in catalogues:
        short = catalogue.replace("_INDEXING_TESTS", "").replace("_TESTS", "").lower()
        seen = {}
        for name, specs in getattr(J, catalogue):
            for spec in specs:  # a name may come twice (MIXED_ADVANCED_INDEXING_TESTS)
                seen[name] = seen.get(name, -1) + 1
                yield f"{short}-{name}{seen[name]}", spec


def _take_cases():
    catalogues = (
        "STATIC_INDEXING_TESTS",
        "STATIC_INDEXING_OUT_OF_BOUNDS_TESTS",
        "DYNAMIC_SLICE_TESTS",
        "ADVANCED_INDEXING_TESTS",
        "MIXED_ADVANCED_INDEXING_TESTS",
    )
    for name, spec in _specs(*catalogues):
        yield f"take-{name}-getitem", ("take", spec, None, None)
        for strategy, mode in itertools.product(_STRATEGIES, [None, "clip", "promise_in_bounds"]):
            yield f"take-{name}-{strategy.name}-{mode}", ("take", spec, strategy, mode)
        for mode in J.MODES:
            yield f"take-{name}-get-{mode}", ("get", spec, None, mode)


def _is_integer_indexer(indexer) -> bool:
    parts = indexer if isinstance(indexer, tuple) else (indexer,)
    return all(isinstance(p, int | np.integer | np.ndarray) for p in parts) and any(
        not isinstance(p, np.ndarray) or p.size for p in parts
    )


def _traced_cases():
    catalogues = (
        "STATIC_INDEXING_TESTS",
        "ADVANCED_INDEXING_TESTS",
        "MIXED_ADVANCED_INDEXING_TESTS",
    )
    seen = set()
    for name, spec in _specs(*catalogues):
        key = (spec.shape, repr(spec.indexer))
        if _is_integer_indexer(spec.indexer) and key not in seen:
            seen.add(key)
            yield f"traced-{name}", ("traced", spec, None, None)


def _update_cases():
    ops = [U.ADD, U.SUB, U.MUL, U.UPDATE]
    for mode in [None, *J.MODES]:
        catalogues = ["STATIC_INDEXING_TESTS"]
        if mode != "promise_in_bounds":
            catalogues.append("STATIC_INDEXING_OUT_OF_BOUNDS_TESTS")
        for name, spec in _specs(*catalogues):
            for k, shape in enumerate(J._broadcastable_shapes(spec.out_shape)):
                for op in ops:
                    case = ("update", spec, (op, shape, True), mode)
                    yield f"update-{name}-u{k}-{op.name}-{mode}", case
    for unique in (False, True):
        catalogue = "ADVANCED_INDEXING_TESTS" + ("_NO_REPEATS" if unique else "")
        for name, spec in _specs(catalogue):
            for k, shape in enumerate(J._broadcastable_shapes(spec.out_shape)):
                for op in ops if unique else [U.ADD, U.SUB]:
                    case = ("update", spec, (op, shape, unique), None)
                    yield f"update-{name}-u{k}-{op.name}-{'unique' if unique else 'repeats'}", case
    for name, spec in _specs(*_VALUES):
        for k, shape in enumerate(J._broadcastable_shapes(spec.out_shape)):
            for op in (U.MIN, U.MAX, U.DIV, U.POW):
                case = ("update", spec, (op, shape, True), None)
                yield f"update-{name}-u{k}-{op.name}-values", case


def _segment_cases():
    # JAX's testSegmentReduce: `reducer`, `shape`, `bucket_size`, `num_segments`.
    reducers = ("segment_sum", "segment_prod", "segment_min", "segment_max")
    shapes = [(8,), (7, 4), (6, 4, 2)]
    for reducer, shape, bucket, n in itertools.product(reducers, shapes, [None, 2], [None, 1, 3]):
        spec = J.IndexSpec(shape=shape, indexer=None)
        for traced in (False, True) if n is not None else (False,):
            name = f"segment-{reducer}-{'x'.join(map(str, shape))}-b{bucket}-n{n}"
            name += "-traced" if traced else ""
            yield name, ("segment", spec, (reducer, bucket, n), traced)


def _params():
    cases = [*_take_cases(), *_traced_cases(), *_segment_cases()]
    updates = list(_update_cases())
    params = []
    for i, (name, case) in enumerate(cases + updates):
        sampled = i < len(cases) or (i - len(cases)) % 7 == 0
        for j, dtype in enumerate(("float64", "float32")):
            marks = () if sampled and (i + j) % 2 == 0 else pytest.mark.sweep
            params.append(pytest.param(case, dtype, marks=marks, id=f"{name}-{dtype}"))
    return params


def _program(case, dtype):
    """`(fn, args, argnums, int_args)` of one case: `fn(*args, *int_args)`. A case is
    `(kind, IndexSpec, extra, mode)`: `mode` is JAX's indexing mode, or for `segment`
    whether the ids are traced."""
    kind, spec, extra, mode = case
    rng = np.random.RandomState(0)
    positive = kind == "update" and extra[0] in (U.DIV, U.POW)

    def draw(shape):
        values = 0.5 + rng.rand(*shape) if positive else rng.randn(*shape)
        return jnp.asarray(values, dtype)

    x = draw(spec.shape)
    if kind == "take":
        if extra is None:
            return (lambda x: x[spec.indexer]), (x,), 0, ()
        take = J.indexing.rewriting_take
        return (lambda x: take(x, spec.indexer, strategy=extra, mode=mode)), (x,), 0, ()
    if kind == "get":
        return (lambda x: x.at[spec.indexer].get(mode=mode, fill_value=7)), (x,), 0, ()
    if kind == "segment":
        reducer, bucket, n = extra
        ids = rng.randint(-2, 3, spec.shape[:1]).astype(np.int32)
        reduce = getattr(J.ops, reducer)
        if mode:  # traced ids

            def fn(x, ids):
                return reduce(x, ids, num_segments=n, bucket_size=bucket)

            return fn, (x,), 0, (jnp.asarray(ids),)
        return (lambda x: reduce(x, ids, num_segments=n, bucket_size=bucket)), (x,), 0, ()
    if kind == "traced":
        parts = spec.indexer if isinstance(spec.indexer, tuple) else (spec.indexer,)
        ints = tuple(jnp.asarray(p, jnp.int32) for p in parts)
        single = not isinstance(spec.indexer, tuple)
        return (lambda x, *ix: x[ix[0] if single else ix]), (x,), 0, ints
    op, update_shape, unique = extra
    y = draw(update_shape)

    def fn(x, y):
        return U.jax_fn(op, spec.indexer, x, y, mode=mode, unique_indices=unique)

    return fn, (x, y), (0, 1), ()


@pytest.mark.parametrize("case, dtype_name", _params())
def test_indexing(case, dtype_name):
    fn, args, argnums, ints = _program(case, getattr(jnp, dtype_name))
    if any(0 in a.shape for a in args):
        pytest.skip("an empty input: no Jacobian entries to compare")
    full = lambda *a: fn(*a, *ints)  # noqa: E731
    if case[0] == "segment" and case[2][2] is None:
        # The number of segments read from the ids: refused under `jax.jit`, and by ours.
        with pytest.raises(jax.errors.ConcretizationTypeError) as info:
            dl.materialise(full, *args, argnums=argnums)
        assert "pass `num_segments=`" in "".join(getattr(info.value, "__notes__", []))
        return
    try:
        full(*args)
    except (TypeError, IndexError) as e:
        # As JAX's tests skip them: array indices with the static- or dynamic-slice
        # strategy, strides other than 1 and -1 with the dynamic-slice strategy,
        # out-of-bounds integers with the static-slice strategy.
        pytest.skip(f"JAX refuses this indexer with this strategy: {e}")
    try:
        forward = jax.jacfwd(full, argnums=argnums)(*args)
        backward = jax.jacrev(full, argnums=argnums)(*args)
    except NotImplementedError as e:  # scatter-mul's JVP on repeated indices
        pytest.skip(f"JAX raises: {e}")

    @jax.jit
    def both_modes(args, ints):
        g = lambda *a: fn(*a, *ints)  # noqa: E731
        return tuple(
            dl.materialise(g, *args, argnums=argnums, mode=m) for m in ("forward", "reverse")
        )

    # `ints` traced too: for `traced` cases that is the point, elsewhere there are none.
    jit_forward, jit_reverse = both_modes(args, ints)
    auto = dl.materialise(full, *args, argnums=argnums)
    # Per argument: `materialise_operator`'s matrix, and JAX's two blocks for it.
    operators = []
    for k in argnums if isinstance(argnums, tuple) else (argnums,):
        ref = (forward[k], backward[k]) if isinstance(argnums, tuple) else (forward, backward)
        matrix = dl.materialise_operator(full, *args, argnums=k).as_matrix()
        operators.append((f"materialise_operator, argument {k}", matrix.reshape(ref[0].shape), ref))

    if not _equal(forward, backward):
        # JAX's own two modes disagree: an out-of-bounds index under promise_in_bounds,
        # which JAX leaves undefined (the gather clamps, its transpose drops). Each of
        # ours must be one of JAX's two answers.
        ours = [("forward", jit_forward, (forward, backward))]
        ours += [("reverse", jit_reverse, (forward, backward))]
        ours += [("auto", auto, (forward, backward)), *operators]
        for what, value, (f, b) in ours:
            assert _equal(value, f) or _equal(value, b), what
        return
    assert_jacobian_equal(jit_forward, forward, what="jit, forward mode vs jax.jacfwd")
    assert_jacobian_equal(jit_reverse, backward, what="jit, reverse mode vs jax.jacrev")
    assert_jacobian_equal(auto, forward, what="eager, automatic mode vs jax.jacfwd")
    for what, matrix, (expected, _) in operators:
        assert_jacobian_equal(matrix, expected, what=what)


def _equal(a, b) -> bool:
    try:
        assert_jacobian_equal(a, b)
    except AssertionError:
        return False
    return True
