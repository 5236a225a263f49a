"""JAX 0.10.2's own tests of control flow, custom derivatives, linear algebra and special
functions, with `materialise` checked on every function they differentiate.

`make test-jax-shadow` (or `python tests/jax_shadow_suite.py [pytest arguments]`) runs
JAX's `lax_control_flow_test.py`, `custom_root_test.py`, `custom_linear_solve_test.py`,
`custom_api_test.py`, `linalg_test.py` and `lax_scipy_test.py` (`--files` chooses others
from `BLOBS`) under pytest, in float64 (`--x32`: without x64, JAX's default, as JAX's
CI runs them too), with this module as a plugin. The plugin shadows the entry points
through which those tests differentiate their functions: `jax.jvp`, `jax.jacfwd`,
`jax.jacrev`, `jax.grad` and `check_grads`. Each call whose differentiated arguments are
concrete floating arrays (at most `MAX_SIZE` entries each) also takes, once per test,
function (its code and what it closes over) and point, the Jacobian of the function
through `materialise` in its automatic, forward and reverse modes, and, for one
differentiated argument, `materialise_operator`'s matrix and (square Jacobians)
`jacobian_diagonal`, and compares them with `jax.jacfwd`'s, eager and under `jax.jit`
(reverse mode and the automatic one also with `jax.jacrev`'s;
`helpers.assert_jacobian_equal`, NaN patterns included). Where `jax.jacfwd` fails and
`jax.jacrev` works (a `custom_vjp`, such as `jax.experimental.ode.odeint`), `jax.jacrev`'s,
eager and jitted, are the references (`equal to jacrev`). Then the call goes on to
JAX's own function, so JAX's test runs as written.

The verdict is the shadow's, not the tests': a check is a *defect* where ours differs
from every reference, or raises where JAX differentiates the same function as ours does,
staged: `jax.jacfwd(jax.jit(fn))` (or `jax.jacrev`, as above) and `jax.linearize(fn)`
both succeed (ours traces `fn` as `jax.jit` does and linearises it). A check where they
do not is recorded under the reason: `jax raises` (the test differentiates a function
`jax.jit(jax.jacfwd(fn))` refuses, such as Python control flow on a value), `as jax.jit`
(custom-derivative rules that close over `vmap` tracers: JAX issue #8783), `as
jax.linearize` (a `custom_vmap` without a derivative rule, before ours inlined it),
`nonlinear rule` (a `custom_jvp` rule whose tangent is not linear in the input tangents,
which JAX's symbolic-zero tests write on purpose; or a VJP that is not linear in the
cotangent, `odeint`'s adaptive backward solve, `_linear_vjp`: there is no Jacobian to
agree on), `under a trace` (JAX's Jacobian is itself a tracer: rules that close over a
value an enclosing `jax.jit` traces), `batching rule differs` (a `custom_vmap` whose
batching rule computes another function, so that `jax.jacfwd` and `jax.jvp` disagree:
`_consistent_batching`). The run prints every defect with its test and exits 1 if there
is one, or if the shadow itself failed to check a function (`shadow error`). JAX's tests
themselves may fail under the shadow where they count the calls of their functions or
their derivative rules; their outcomes are printed, not judged.

JAX's tests are not in the jax wheel, and come from JAX's git repository, as for
`jax_indexing_suite.py`: `JAX_TESTS=/path/to/tests`, `JAX_GIT=/path/to/jax` (a clone or
bare git directory with the tag `jax-v0.10.2`), or a shallow clone from GitHub into
`.jax-tests/`; each file is checked against its git blob hash. The result is recorded in
`docs/devdocs/structure_engine.md`.
"""

import collections
import json
import os
import pathlib
import subprocess
import sys
import tempfile


TAG = "jax-v0.10.2"
REPO = "https://github.com/jax-ml/jax"
# `git rev-parse jax-v0.10.2:tests/<file>` in JAX's repository.
BLOBS = {
    "lax_control_flow_test.py": "473022875d0392651da7056a71e47b971a5bf83e",
    "custom_api_test.py": "2222d4f006cb0f89030d48eb3e079bb0ed0cec2a",
    "linalg_test.py": "c43c27f2c6c66b512aa4bfd8b3193ac8b772072e",
    "lax_scipy_test.py": "e1d6d8a4fa46fea0d4d390c817c2bdceeb66f8da",
    "lax_autodiff_test.py": "969671cd5b3746e16ce10ed3c87ff9d88693cdfc",
    "api_test.py": "b16bb7e9e77be50b9a3b78eb2db407570cd06239",
    "custom_root_test.py": "6a7eaab1765785968395774d9255f2c6efeb5f05",
    "custom_linear_solve_test.py": "dd99dd774143d141a8a0e6769d031dd9169c1d43",
    "nn_test.py": "c179d8c13d33c4805afde428358aabee1474e2fe",
    "sparse_test.py": "8923c4339ba25b751a56edb670afcbcbb116b513",
    "lax_test.py": "da93ccaab6683be0283dc578888d0be2e034a14f",
    "lax_numpy_test.py": "53e40b4243df798041b31bfde3b31f85ed1bb91f",
    "ode_test.py": "43a53ed2f2394878a2ead4ca17c26f2aabb27e21",
    "batching_test.py": "fd0f25b24afd5f6eb0fabd3bf1b70743ac14e0c0",
    "sparse_bcoo_bcsr_test.py": "52dd666931eac647ae4deaf3de400e61ca24e4f4",
    "random_lax_test.py": "3d71feaddf86fa6b161fdc00f3a389376b913ef0",
    "lax_scipy_sparse_test.py": "21169a4d9a1a30a8a474b27d875e37573df548e8",
    "lax_scipy_special_functions_test.py": "0d600eea940a7250ebe755af8ea6110d4104c562",
    "fft_test.py": "cd869a1fa977e767ab36cfbba2c9b48aed1d6af9",
    "image_test.py": "7d06c924655f65daa1e9b43f7208867a31a5b8a1",
    "checkify_test.py": "d1b0f9f59f6ec00c1320acf61cff22d1a3727766",
    "state_test.py": "dbc254d8b26dd5c94ae45ad8e79667e8855c21fa",
}
DEFAULT_FILES = [
    "lax_control_flow_test.py",
    "custom_root_test.py",
    "custom_linear_solve_test.py",
    "custom_api_test.py",
    "linalg_test.py",
    "lax_scipy_test.py",
]
MAX_SIZE = 400
_LOG = "DL_JAX_SHADOW_LOG"


def main(argv) -> int:
    from outside_suite import fetch, require_jax

    require_jax(TAG, f"JAX {TAG[5:]}'s tests")
    x64 = "--x32" not in argv
    argv = [a for a in argv if a != "--x32"]
    files = DEFAULT_FILES
    if "--files" in argv:
        k = argv.index("--files")
        files = argv[k + 1].split(",")
        argv = argv[:k] + argv[k + 2 :]
        unknown = [f for f in files if f not in BLOBS]
        if unknown:
            sys.exit(f"--files: not among {sorted(BLOBS)}: {unknown}")
    here = pathlib.Path(__file__).resolve().parent
    with tempfile.TemporaryDirectory(prefix="jax-shadow-suite-") as tmp:
        tmp = pathlib.Path(tmp)
        fetch(tmp, "jax", REPO, TAG, {f: BLOBS[f] for f in files})
        log = tmp / "shadow.jsonl"
        path = os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])
        env = dict(os.environ, **{_LOG: str(log), "PYTHONPATH": path})
        env["JAX_ENABLE_X64"] = "1" if x64 else "0"
        command = [sys.executable, "-m", "pytest", "-p", "jax_shadow_suite"]
        command += ["-p", "no:cacheprovider", "-W", "ignore", *files, *argv]
        print("+", " ".join(command), flush=True)
        code = subprocess.run(command, cwd=tmp, env=env).returncode
        lines = log.read_text().splitlines() if log.exists() else []
        records = [json.loads(line) for line in lines]
    return _verdict(records, code)


def _verdict(records, pytest_code) -> int:
    counts = collections.Counter((r["file"], r["status"]) for r in records)
    print(f"\nShadow checks of materialise ({len(records)}), by file and outcome:")
    for (file, status), n in sorted(counts.items()):
        print(f"  {file:28} {status:18} {n}")
    defects = [r for r in records if r["status"] in ("defect", "shadow error")]
    for r in defects:
        print(f"\n{r['status'].upper()} in {r['test']} ({r['source']}):\n  {r['detail']}")
    print(
        f"\n{len(defects)} defects or failed checks; pytest's own exit status {pytest_code} "
        "(JAX's tests are not the verdict: see the docstring)."
    )
    if not records:
        print("No function was checked: a run that checks nothing fails.")
    return 1 if defects or not records else 0


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    sys.exit(main(sys.argv[1:]))


# ---- the pytest plugin (loaded with `-p jax_shadow_suite`, `DL_JAX_SHADOW_LOG` set) ------

import functools  # noqa: E402
import hashlib  # noqa: E402
import re  # noqa: E402
import traceback  # noqa: E402

import diffrax_linearize as dl  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.test_util  # noqa: E402
import numpy as np  # noqa: E402
from helpers import assert_jacobian_equal  # noqa: E402
from jax._src import api, public_test_util, test_util  # noqa: E402


_REAL = {
    "jvp": api.jvp,
    "jacfwd": jax.jacfwd,
    "jacrev": jax.jacrev,
    "grad": jax.grad,
    "check_grads": public_test_util.check_grads,
}
_seen: set = set()
_busy = [False]


def _checkable(args, argnums) -> bool:
    leaves = jax.tree.leaves(args)
    if not leaves or any(isinstance(x, jax.core.Tracer) for x in leaves):
        return False
    for k in argnums:
        diff = jax.tree.leaves(args[k])
        if not diff:
            return False
        for x in diff:
            if not isinstance(x, (float, np.ndarray, np.generic, jax.Array)):
                return False
            if not jnp.issubdtype(jnp.result_type(x), jnp.floating) or np.size(x) > MAX_SIZE:
                return False
    return True


def _describe(obj, depth=0) -> str:
    """A text that tells functions apart by their code and what they close over, and
    arrays by their contents; the same in every process."""
    if depth > 3:
        return "..."
    if isinstance(obj, functools.partial):
        parts = [obj.func, *obj.args, *sorted(obj.keywords.items())]
        return "partial(" + ",".join(_describe(p, depth + 1) for p in parts) + ")"
    code = getattr(obj, "__code__", None)
    if code is not None:
        cells = [c.cell_contents for c in (obj.__closure__ or ()) if _filled(c)]
        inner = ",".join(_describe(c, depth + 1) for c in cells)
        return f"{obj.__qualname__}:{hashlib.sha1(code.co_code).hexdigest()}({inner})"
    if isinstance(obj, (np.ndarray, jax.Array)) and not isinstance(obj, jax.core.Tracer):
        data = np.asarray(obj)
        return f"{data.dtype}{data.shape}:{hashlib.sha1(data.tobytes()).hexdigest()}"
    return re.sub(r" at 0x[0-9a-f]+", "", repr(obj))[:200]


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def _current_test() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]


def _key(fn, args, argnums) -> str:
    """The test, the function (code and closure) and the point: one check each (a test
    runs in one worker, so each worker's `_seen` makes the records unique)."""
    leaves = [_describe(x) for x in jax.tree.leaves(args)]
    text = repr((_current_test(), _describe(fn), leaves, argnums))
    return hashlib.sha1(text.encode()).hexdigest()


def _equal_to_any(value, references) -> str | None:
    """`None` if `value` is one of `references` (Jacobians), else why not (the first)."""
    why = None
    for ref in references:
        try:
            assert_jacobian_equal(value, ref, ulps=4096)
            return None
        except AssertionError as e:
            why = why or str(e)[:600]
    return why


def _linear_rule(fn, args) -> bool:
    """Whether `fn`'s JVP maps zero tangents to zero (a custom rule may not)."""
    zeros = jax.tree.map(jnp.zeros_like, tuple(args))
    _, tangents = _REAL["jvp"](fn, tuple(args), zeros)
    return not any(np.any(np.asarray(t) != 0) for t in jax.tree.leaves(tangents))


def _linear_vjp(fn, args, nums) -> bool:
    """Whether `fn`'s VJP is linear in the cotangent, as far as two tests tell: it is
    homogeneous (the pullback of `1024 * c` is `1024` times that of `c`: exact in floating
    point for a linear map, with `c` all ones), and the pullback of `c` is the sum of the
    pullbacks of the basis (`jax.jacrev`'s rows). A custom rule may not be linear:
    `odeint`'s backward solve adapts its steps to the cotangent (its absolute tolerance),
    so each Jacobian row and each product is right only to the solver's tolerance, and
    a Jacobian formed through other cotangents than JAX's differs by that much."""

    def flat(*d):
        out = fn(*_merge(args, nums, d))
        return jnp.concatenate([jnp.ravel(o) for o in jax.tree.leaves(out)])

    diff = [args[k] for k in nums]
    out, pullback = jax.vjp(flat, *diff)
    ones = jnp.ones_like(out)
    pulled = pullback(ones)
    scaled = jax.tree.map(lambda v: v / 1024, pullback(1024 * ones))
    if _equal_to_any(scaled, [pulled]) is not None:
        return False
    rows = _REAL["jacrev"](flat, argnums=tuple(range(len(diff))))(*diff)
    summed = jax.tree.map(lambda r: jnp.sum(r, axis=0), rows)
    return _equal_to_any(pulled, [summed]) is None


def _rows(jac, diff) -> list:
    """The blocks of `jac` (a Jacobian as `jax.jacfwd` or `jax.jacrev` returns it with
    respect to `diff`, a list of the differentiated arguments), output leaf by output
    leaf, each a list over `diff`'s leaves."""
    n = len(jax.tree.leaves(diff))
    leaves = jax.tree.leaves(jac)
    return [leaves[k : k + n] for k in range(0, len(leaves), n)] if n else []


def _shaped_as_inputs(jac, args, nums) -> bool:
    """Whether every block of `jac` (as `jax.jacrev` returns it) ends in its input's
    shape."""
    diff = [args[k] for k in nums]
    shapes = [np.shape(x) for x in jax.tree.leaves(diff)]
    if not shapes or len(jax.tree.leaves(jac)) % len(shapes):
        return not shapes
    return all(
        tuple(np.shape(b)[len(np.shape(b)) - len(s) :]) == tuple(s)
        for row in _rows(jac, diff)
        for b, s in zip(row, shapes)
    )


def _consistent_batching(fn, args, nums, forward) -> bool:
    """Whether JAX's own forward derivative is the same batched and not: `jax.jacfwd`'s
    Jacobian (a `jax.vmap` over the basis) applied to ones, against one `jax.jvp` along
    ones. A `custom_vmap` whose batching rule computes another function than its own
    (JAX's test_partial_eval_raises writes one on purpose) has two derivatives."""
    diff = [args[k] for k in nums]
    ins = [np.size(x) for x in jax.tree.leaves(diff)]
    ones = jax.tree.map(jnp.ones_like, diff)
    _, tangent = _REAL["jvp"](lambda *d: fn(*_merge(args, nums, d)), diff, ones)
    for out, row in zip(jax.tree.leaves(tangent), _rows(forward, diff)):
        pushed = sum(jnp.reshape(b, (np.size(out), i)).sum(axis=1) for b, i in zip(row, ins))
        if _equal_to_any(pushed, [jnp.ravel(out)]) is not None:
            return False
    return True


def _staged_reason(fn, args, argnums, transform="jacfwd") -> str | None:
    """Why JAX's staged differentiation of `fn` fails, as ours would, or `None`."""
    try:
        _REAL[transform](jax.jit(fn), argnums=argnums)(*args)
    except Exception:
        return "as jax.jit"
    try:
        jax.linearize(lambda *d: fn(*_merge(args, argnums, d)), *[args[k] for k in argnums])
    except Exception:
        return "as jax.linearize"
    return None


def _merge(args, argnums, diff):
    args = list(args)
    for k, d in zip(argnums, diff):
        args[k] = d
    return args


def _check(fn, args, argnums, source):
    """Compare `materialise(fn, *args, argnums=argnums)` with JAX's Jacobians, once per
    function and point, and append the outcome to the log."""
    args = tuple(args)
    single = isinstance(argnums, int)
    nums = (argnums,) if single else tuple(argnums)
    if _busy[0] or not _checkable(args, nums):
        return
    key = _key(fn, args, nums)
    if key in _seen:
        return
    _seen.add(key)
    _busy[0] = True
    argnums = argnums if single else nums
    record = {"source": source, "status": "equal", "detail": ""}
    try:
        record.update(_compare(fn, args, argnums, nums))
    except Exception as e:  # the shadow itself: never the test's business
        where = "".join(traceback.format_list(traceback.extract_tb(e.__traceback__)[-6:]))
        record.update(status="shadow error", detail=f"{type(e).__name__}: {e}"[:600] + where)
    finally:
        _busy[0] = False
    test = _current_test()
    record.update(test=test, file=test.split("::")[0])
    with open(os.environ[_LOG], "a") as f:
        f.write(json.dumps(record) + "\n")


def _compare(fn, args, argnums, nums) -> dict:
    """The check's outcome: `argnums` as the test gave it, `nums` as a tuple."""
    only_reverse = False
    try:
        forward = _REAL["jacfwd"](fn, argnums=argnums)(*args)
        jitted = jax.jit(_REAL["jacfwd"](fn, argnums=argnums))(*args)
    except Exception as e:
        # Forward mode may fail where reverse mode works (a `custom_vjp`, such as
        # `jax.experimental.ode.odeint`): then `jax.jacrev`'s, eager and jitted, are the
        # references, for every mode of ours.
        try:
            forward = _REAL["jacrev"](fn, argnums=argnums)(*args)
            jitted = jax.jit(_REAL["jacrev"](fn, argnums=argnums))(*args)
            only_reverse = True
        except Exception:
            return {"status": "jax raises", "detail": f"{type(e).__name__}: {e}"[:300]}
        if not _shaped_as_inputs(forward, args, nums):
            # A `bwd` rule returning cotangents of other shapes, with JAX's checks
            # disabled (test_bwd_rule_shape_mismatch_disable): no Jacobian.
            return {"status": "jax raises", "detail": "jax.jacrev: blocks not shaped as inputs"}
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(forward)):
        # A function whose rules close over a value traced outside it (a `bwd` rule
        # capturing an enclosing `jax.jit`'s argument): its Jacobian is traced too.
        return {"status": "under a trace"}
    if not all(jnp.issubdtype(np.result_type(x), jnp.inexact) for x in jax.tree.leaves(forward)):
        return {"status": "integer output"}
    try:
        ours = {m: dl.materialise(fn, *args, argnums=argnums, mode=m) for m in _MODES}
    except Exception as e:
        why = f"{type(e).__name__}: {e}"[:600]
        reason = _staged_reason(fn, args, nums, "jacrev" if only_reverse else "jacfwd")
        if reason:
            return {"status": reason, "detail": why}
        return {"status": "defect", "detail": f"ours raise: {why}\n{traceback.format_exc()[-800:]}"}
    try:
        backward = forward if only_reverse else _REAL["jacrev"](fn, argnums=argnums)(*args)
    except Exception:
        backward = forward
    wrong = {}
    for mode, value in ours.items():
        # The automatic mode is reverse mode where `jax.jacrev` would be the choice.
        refs = (forward, jitted) if mode == "forward" else (forward, jitted, backward)
        why = _equal_to_any(value, refs)
        if why:
            wrong[mode] = why
    if isinstance(argnums, int):
        wrong.update(_compare_flat(fn, args, argnums, (forward, jitted, backward)))
    if not wrong:
        return {"status": "equal to jacrev" if only_reverse else "equal"}
    linear = _linear_vjp(fn, args, nums) if only_reverse else _linear_rule(fn, args)
    if not linear:
        return {"status": "nonlinear rule", "detail": json.dumps(wrong)[:600]}
    if not only_reverse and not _consistent_batching(fn, args, nums, forward):
        return {"status": "batching rule differs", "detail": json.dumps(wrong)[:600]}
    return {"status": "defect", "detail": f"ours differ from JAX's: {json.dumps(wrong)[:1200]}"}


_MODES = ("auto", "forward", "reverse")


def _flat(jac, args, argnums):
    """`jac`, a Jacobian as `jax.jacfwd` returns it for one argument, as a matrix: the
    output's leaves flattened and joined by the argument's (lineax's order)."""
    ins = [np.size(x) for x in jax.tree.leaves(args[argnums])]
    blocks = _rows(jac, [args[argnums]])
    outs = [next((np.size(b) // i for b, i in zip(row, ins) if i), 0) for row in blocks]
    rows = [[jnp.reshape(b, (o, i)) for b, i in zip(row, ins)] for row, o in zip(blocks, outs)]
    return jnp.block(rows) if rows and ins else jnp.zeros((sum(outs), sum(ins)))


def _compare_flat(fn, args, argnums, references) -> dict:
    """`materialise_operator`'s matrix and, for a square Jacobian, `jacobian_diagonal`,
    against `references` (Jacobians as `jax.jacfwd` returns them for one argument)."""
    flats = [_flat(r, args, argnums) for r in references]
    wrong = {}
    try:
        matrix = dl.materialise_operator(fn, *args, argnums=argnums).as_matrix()
        wrong["materialise_operator"] = _equal_to_any(matrix, flats)
    except Exception as e:
        wrong["materialise_operator"] = f"ours raise: {type(e).__name__}: {e}"[:600]
    n_out, n_in = flats[0].shape
    if n_out == n_in:
        x = args[argnums]
        try:
            diag = dl.jacobian_diagonal(lambda z: fn(*_merge(args, (argnums,), (z,))), x)
            diag = jnp.concatenate([jnp.ravel(d) for d in jax.tree.leaves(diag)] or [diag])
            wrong["jacobian_diagonal"] = _equal_to_any(diag, [jnp.diagonal(f) for f in flats])
        except Exception as e:
            wrong["jacobian_diagonal"] = f"ours raise: {type(e).__name__}: {e}"[:600]
    return {k: v for k, v in wrong.items() if v}


def _shadow_check_grads(f, args, order, *rest, **kwargs):
    _check(f, args, tuple(range(len(args))), "check_grads")
    return _REAL["check_grads"](f, args, order, *rest, **kwargs)


def _shadow_jvp(fun, primals, tangents, *rest, **kwargs):
    # Only the tests' own calls: JAX's internals call `api.jvp` too, on functions that
    # must run once (`custom_vmap`'s rules store their outputs).
    caller = sys._getframe(1).f_globals.get("__name__", "")
    if caller.startswith("jax."):
        return _REAL["jvp"](fun, primals, tangents, *rest, **kwargs)
    if not rest and not kwargs.get("has_aux") and isinstance(primals, (tuple, list)):
        _check(fun, primals, tuple(range(len(primals))), "jvp")
    return _REAL["jvp"](fun, primals, tangents, *rest, **kwargs)


def _shadowed(name):
    real = _REAL[name]

    @functools.wraps(real)  # its name too: JAX's tests name parameterised cases by it
    def transform(fun, argnums=0, *rest, **kwargs):
        transformed = real(fun, argnums, *rest, **kwargs)
        options = ("has_aux", "holomorphic", "allow_int", "reduce_axes")
        if rest or any(kwargs.get(k) for k in options):
            return transformed

        @functools.wraps(transformed)
        def call(*args, **kw):
            if not kw:
                _check(fun, args, argnums, name)
            return transformed(*args, **kw)

        return call

    return transform


def pytest_configure(config):
    if _LOG not in os.environ:
        raise RuntimeError(f"jax_shadow_suite is a plugin of its own driver: set {_LOG}.")
    api.jvp = jax.jvp = _shadow_jvp
    public_test_util.check_grads = _shadow_check_grads
    test_util.check_grads = jax.test_util.check_grads = _shadow_check_grads
    jax.jacfwd = _shadowed("jacfwd")
    jax.jacrev = _shadowed("jacrev")
    jax.grad = _shadowed("grad")
