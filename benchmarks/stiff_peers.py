"""Stiff solvers against their peers: work-precision on the stiff IVP test set, Robertson x N
and the 2D Brusselator. Float64; times are rough on a shared machine (ratios in one run).

Problems and published reference end values: the Test Set for IVP Solvers (Bari; F. Mazzia
and C. Magherini, release 2.4, https://archimede.uniba.it/~testset/), the `solut`
subroutines of `hires.f`, `orego.f`, `pollu.f`, `rober.f` and `vdpol.f` (computed with
RADAU5 in quadruple-like precision, uround 1.01e-19). Each is re-checked here against a tight
scipy Radau solve (rtol 1e-12) in `self_check()`.

Accuracy: the test set's mixed-error significant correct digits (as `printpr` of the
test set's R port, deTestSet): `mescd = -log10(max_i |y_i - ref_i| / (atol/rtol + |ref_i|))`.
Tolerances: atol = rtol, except ROBER where atol = 1e-4 rtol (deTestSet's `rober` defaults,
rtol 1e-10 and atol 1e-14).

Robertson x N: N identical systems, t in [0, 1e10] (diffsol's benchmark); the 2D Brusselator
on a periodic n x n grid, t in [0, 1] (`benchmarks/structure.py`).

Contenders: ours (`Kvaerno5(root_finder=dl.VeryChord())`, `... dl.Newton()`, and
`dl.Rodas5P()`, `dl.Rodas4P()`, the W-method `dl.ROS34PW2()`, `dl.BDF()` (Jacobian
and factorisation reused across steps; fixed order 3) and `dl.BDF(max_order=5,
variable_order=True)` ("ours BDF var", with `diffrax.PIDController(pcoeff=0.3, icoeff=0.4)`)
where the package has them, the three Rosenbrock
solvers and Kvaerno5 with our root finders with `dl.PredictiveController`, ROS34PW2's with
`steady=(0.9, 1.2)`; fixed-order BDF with `diffrax.PIDController`), Diffrax's default
`Kvaerno5()`, scipy BDF and Radau (with `jac_sparsity` on the large problems), and optional
peers: SUNDIALS CVODE (scikit-sundae), diffsol (pydiffsol, BDF and ESDIRK34) and casadi
(cvodes). A peer not installed gives a row saying so.

`--quick` (a minute or two): HIRES and ROBER at rtol 1e-4 and 1e-6, Robertson x N for
N in {1, 100} and the 16 x 16 Brusselator at rtol 1e-6; it writes `stiff_peers_quick-*` in
`benchmarks/results/quick/` (or `$DIFFRAX_LINEARIZE_RESULTS`), the full sweep `stiff_peers-*`.
CVODE's GMRES (no preconditioner) runs on the Brusselator only. A contender slower than
`slow_s` at one tolerance is skipped at the tighter ones, with a row saying so. The
contenders of one case and tolerance are timed interleaved (A B C A B C ...: three rounds
and at least 0.5 s of timed solves each, so that a solve of 50 ms is timed ten times rather
than three; a contender stops after 20 s of timed solves): times in the table are each
contender's fastest run, with how far its median lay above it; ratios are ours / this
contender's, by fastest runs, same case. Ours and Diffrax's are compiled once per case,
the tolerances being arguments of the compiled solve (`compile_s` is that one compile).

Equal accuracy (`equal_accuracy`, issue 23's acceptance on the Brusselator): for each run
of CVODE, diffsol and casadi, the time of "ours BDF var" at that run's significant correct
digits, log-time interpolated in digits between two of ours' runs (`time_at_digits`). Two
decades of rtol are about two digits apart, so on the Brusselator ours is also solved at
the quarter decades of rtol between them (rows marked `between`, same settings and timing
rule, timed alone; left out of the summary table, small open markers in the plot), and
the reading spans a quarter of a decade.

    python -m benchmarks stiff-peers [--quick]
    python -m benchmarks.stiff_peers --problems brusselator_2d --sizes 64 --update
    python -m benchmarks.stiff_peers --methods "ours BDF" --update

The last two re-run some cases (`--problems`, `--sizes`: a test-set problem's size is its
number of unknowns, Robertson's N, the Brusselator's grid side) or contenders (`--methods`)
and keep the other rows of the recorded result, each saying in `recorded` when it was
measured (`earlier_runs` holds the older runs' machines and peer versions); the summary and
the cost per step are recomputed from the merged rows, and the loop floor is measured again
with Robertson N = 1 (else kept, as the rows it is read beside).
"""

import argparse
import functools as ft
import math
import time
from collections.abc import Callable

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.scipy.linalg
import matplotlib
import numpy as np
import scipy.integrate
import scipy.sparse


matplotlib.use("Agg")
import diffrax_linearize as dl
import matplotlib.pyplot as plt

from benchmarks._common import (
    fmt_ratio,
    fmt_spread,
    fmt_time,
    kept_rows,
    machine,
    markdown_table,
    parse_partial_rerun,
    recorded_result,
    save_plot,
    time_round_robin,
    write_results,
)


# ---- problems, written once for jnp, numpy, casadi and DiffSL strings ----------------------


class _S:
    """A DiffSL expression string under arithmetic (so one RHS serves every peer)."""

    def __init__(self, s):
        self.s = s

    @staticmethod
    def _w(x):
        return x.s if isinstance(x, _S) else repr(float(x))

    def __add__(self, o):
        return _S(f"({self.s} + {_S._w(o)})")

    def __radd__(self, o):
        return _S(f"({_S._w(o)} + {self.s})")

    def __sub__(self, o):
        return _S(f"({self.s} - {_S._w(o)})")

    def __rsub__(self, o):
        return _S(f"({_S._w(o)} - {self.s})")

    def __mul__(self, o):
        return _S(f"({self.s} * {_S._w(o)})")

    def __rmul__(self, o):
        return _S(f"({_S._w(o)} * {self.s})")

    def __truediv__(self, o):
        return _S(f"({self.s} / {_S._w(o)})")

    def __neg__(self):
        return _S(f"(-{self.s})")

    def __pow__(self, k):
        return _S("(" + " * ".join([self.s] * int(k)) + ")")


def hires(y):
    k1, k2, k3, k4, k5, k6, k7, k8, k9, oks = (
        1.71,
        0.43,
        8.32,
        0.69,
        0.035,
        8.32,
        280.0,
        0.69,
        0.69,
        0.0007,
    )  # noqa: E501
    f7 = k7 * y[5] * y[7] - (k2 + k8 + k9) * y[6]
    return [
        -k1 * y[0] + k2 * y[1] + k6 * y[2] + oks,
        k1 * y[0] - (k2 + k3) * y[1],
        -(k6 + k1) * y[2] + k2 * y[3] + k5 * y[4],
        k3 * y[1] + k1 * y[2] - (k4 + k2) * y[3],
        -(k5 + k1) * y[4] + k2 * (y[5] + y[6]),
        -k7 * y[5] * y[7] + k8 * y[3] + k1 * y[4] - k2 * y[5] + k8 * y[6],
        f7,
        -f7,
    ]


def orego(y):
    return [
        77.27 * (y[1] + y[0] * (1.0 - 8.375e-6 * y[0] - y[1])),
        (y[2] - (1.0 + y[0]) * y[1]) / 77.27,
        0.161 * (y[0] - y[2]),
    ]


def rober(y):
    return [
        -0.04 * y[0] + 1e4 * y[1] * y[2],
        0.04 * y[0] - 1e4 * y[1] * y[2] - 3e7 * y[1] ** 2,
        3e7 * y[1] ** 2,
    ]


def vdpol(y):
    return [y[1], ((1 - y[0] ** 2) * y[1] - y[0]) / 1e-6]


_POLLU_K = [
    0.35,
    26.6,
    1.23e4,
    8.6e-4,
    8.2e-4,
    1.5e4,
    1.3e-4,
    2.4e4,
    1.65e4,
    9e3,
    0.022,
    1.2e4,
    1.88,
    1.63e4,
    4.8e6,
    3.5e-4,
    0.0175,
    1e8,
    4.44e11,
    1240.0,
    2.1,
    5.78,
    0.0474,
    1780.0,
    3.12,
]  # noqa: E501


def pollu(y):
    k = _POLLU_K
    r = [
        k[0] * y[0], k[1] * y[1] * y[3], k[2] * y[4] * y[1], k[3] * y[6], k[4] * y[6],
        k[5] * y[6] * y[5], k[6] * y[8], k[7] * y[8] * y[5], k[8] * y[10] * y[1],
        k[9] * y[10] * y[0], k[10] * y[12], k[11] * y[9] * y[1], k[12] * y[13],
        k[13] * y[0] * y[5], k[14] * y[2], k[15] * y[3], k[16] * y[3], k[17] * y[15],
        k[18] * y[15], k[19] * y[16] * y[5], k[20] * y[18], k[21] * y[18],
        k[22] * y[0] * y[3], k[23] * y[18] * y[0], k[24] * y[19],
    ]  # fmt: skip
    return [
        -r[0] - r[9] - r[13] - r[22] - r[23] + r[1] + r[2] + r[8] + r[10] + r[11] + r[21] + r[24],
        -r[1] - r[2] - r[8] - r[11] + r[0] + r[20],
        -r[14] + r[0] + r[16] + r[18] + r[21],
        -r[1] - r[15] - r[16] - r[22] + r[14],
        -r[2] + r[3] + r[3] + r[5] + r[6] + r[12] + r[19],
        -r[5] - r[7] - r[13] - r[19] + r[2] + r[17] + r[17],
        -r[3] - r[4] - r[5] + r[12],
        r[3] + r[4] + r[5] + r[6],
        -r[6] - r[7],
        -r[11] + r[6] + r[8],
        -r[8] - r[9] + r[7] + r[10],
        r[8],
        -r[10] + r[9],
        -r[12] + r[11],
        r[13],
        -r[17] - r[18] + r[15],
        -r[19],
        r[19],
        -r[20] - r[21] - r[23] + r[22] + r[24],
        -r[24] + r[23],
    ]


# name: (rhs, y0, t1, published reference at t1, atol / rtol)
TEST_SET = {
    "HIRES": (
        hires,
        [1.0, 0, 0, 0, 0, 0, 0, 0.0057],
        321.8122,
        [
            0.7371312573325668e-3,
            0.1442485726316185e-3,
            0.5888729740967575e-4,
            0.1175651343283149e-2,
            0.2386356198831331e-2,
            0.6238968252742796e-2,
            0.2849998395185769e-2,
            0.2850001604814231e-2,
        ],
        1.0,
    ),  # noqa: E501
    "OREGO": (
        orego,
        [1.0, 2.0, 3.0],
        360.0,
        [0.1000814870318523e1, 0.1228178521549917e4, 0.1320554942846706e3],
        1.0,
    ),  # noqa: E501
    "POLLU": (
        pollu,
        [0, 0.2, 0, 0.04, 0, 0, 0.1, 0.3, 0.01, 0, 0, 0, 0, 0, 0, 0, 0.007, 0, 0, 0],
        60.0,
        [
            0.5646255480022769e-1,
            0.1342484130422339,
            0.4139734331099427e-8,
            0.5523140207484359e-2,
            0.2018977262302196e-6,
            0.1464541863493966e-6,
            0.7784249118997964e-1,
            0.3245075353396018,
            0.7494013383880406e-2,
            0.1622293157301561e-7,
            0.1135863833257075e-7,
            0.2230505975721359e-2,
            0.2087162882798630e-3,
            0.1396921016840158e-4,
            0.8964884856898295e-2,
            0.4352846369330103e-17,
            0.6899219696263405e-2,
            0.1007803037365946e-3,
            0.1772146513969984e-5,
            0.5682943292316392e-4,
        ],
        1.0,
    ),  # noqa: E501
    "ROBER": (
        rober,
        [1.0, 0.0, 0.0],
        1e11,
        [0.2083340149701255e-7, 0.8333360770334713e-13, 0.9999999791665050],
        1e-4,
    ),  # noqa: E501
    "VDPOL": (vdpol, [2.0, 0.0], 2.0, [0.1706167732170483e1, -0.8928097010247975], 1.0),
}


def mescd(y, ref, rtol, atol) -> float:
    y, ref = np.asarray(y, float), np.asarray(ref, float)
    err = np.max(np.abs(y - ref) / (atol / rtol + np.abs(ref)))
    return float(-np.log10(err)) if err > 0 else 16.0


def self_check(rtol=1e-12):
    """Published reference values against a tight scipy Radau solve: the digits they agree to."""
    out = {}
    for name, (rhs, y0, t1, ref, ratio) in TEST_SET.items():
        sol = scipy.integrate.solve_ivp(
            lambda t, y: np.array(rhs(y)), (0.0, t1), y0, method="Radau",
            rtol=rtol, atol=rtol * ratio * 1e-2,
        )  # fmt: skip
        out[name] = mescd(sol.y[:, -1], ref, 1.0, ratio)
        assert out[name] > 7, (name, out[name], sol.y[:, -1])
    return out


# ---- large problems ------------------------------------------------------------------------


def rober_stack_np(y):
    y = y.reshape(-1, 3)
    d1 = -0.04 * y[:, 0] + 1e4 * y[:, 1] * y[:, 2]
    d3 = 3e7 * y[:, 1] ** 2
    return np.stack([d1, -d1 - d3, d3], 1).reshape(-1)


def bruss_np(y):
    n = math.isqrt(y.shape[0] // 2)
    u, v = y.reshape(2, n, n)
    a = 0.02 * (n - 1) ** 2

    def lap(w):
        return np.roll(w, 1, 0) + np.roll(w, -1, 0) + np.roll(w, 1, 1) + np.roll(w, -1, 1) - 4 * w

    return np.stack(
        [1 + u * u * v - 4.4 * u + a * lap(u), 3.4 * u - u * u * v + a * lap(v)]
    ).ravel()


def bruss_y0(n):
    xs = np.linspace(0, 1, n)
    X, Y = np.meshgrid(xs, xs)
    return np.concatenate(
        [(22 * (Y * (1 - Y)) ** 1.5).ravel(), (27 * (X * (1 - X)) ** 1.5).ravel()]
    )


def _lap_matrix(n):
    e = scipy.sparse.identity(n, format="csr")
    c = scipy.sparse.diags(
        [1.0, 1.0, -2.0, 1.0, 1.0], [-n + 1, -1, 0, 1, n - 1], shape=(n, n), dtype=float
    )
    lap1 = scipy.sparse.kron(c, e) + scipy.sparse.kron(e, c)
    return scipy.sparse.block_diag([lap1, lap1]).tocsr() * (0.02 * (n - 1) ** 2)


def bruss_sparsity(n):
    m = n * n
    reac = scipy.sparse.bmat([[scipy.sparse.identity(m), scipy.sparse.identity(m)]] * 2)
    return ((abs(_lap_matrix(n)) + reac) != 0).astype(float).tocsc()


def rober_sparsity(N):
    return scipy.sparse.block_diag([np.ones((3, 3))] * N).tocsc()


# ---- contenders ----------------------------------------------------------------------------


def _ours(name):
    rodas5p = getattr(dl, "Rodas5P", None)
    rodas4p = getattr(dl, "Rodas4P", None)
    ros34pw2 = getattr(dl, "ROS34PW2", None)
    bdf = getattr(dl, "BDF", None)
    return {
        "ours VeryChord": lambda: diffrax.Kvaerno5(root_finder=dl.VeryChord()),
        "ours Newton": lambda: diffrax.Kvaerno5(root_finder=dl.Newton()),
        "ours Rodas5P": (lambda: rodas5p()) if rodas5p is not None else None,
        "ours Rodas4P": (lambda: rodas4p()) if rodas4p is not None else None,
        "ours ROS34PW2": (lambda: ros34pw2()) if ros34pw2 is not None else None,
        "ours BDF": (lambda: bdf()) if bdf is not None else None,
        "ours BDF var": (
            (lambda: bdf(max_order=5, variable_order=True))
            if bdf is not None and "variable_order" in getattr(bdf, "__dataclass_fields__", {})
            else None
        ),
        "diffrax default": lambda: diffrax.Kvaerno5(),
    }[name]


JAX_METHODS = [
    "ours VeryChord",
    "ours Newton",
    "ours Rodas5P",
    "ours Rodas4P",
    "ours ROS34PW2",
    "ours BDF",
    "ours BDF var",
    "diffrax default",
]
PEERS = [
    "scipy BDF",
    "scipy Radau",
    "CVODE",
    "CVODE GMRES",
    "diffsol BDF",
    "diffsol ESDIRK34",
    "casadi cvodes",
]  # noqa: E501


def controller_for(solver, rtol, atol):
    """Our Rosenbrock solvers, and `Kvaerno5` with our root finders, with
    `dl.PredictiveController` (Gustafsson's step control, as Hairer's RODAS and RADAU5:
    `diffrax.PIDController` never shrinks the step after an accepted one, which rejected a
    step in four of Rodas4P's on OREGO, and two in five of Kvaerno5's), holding the step
    size for the W-methods (`steady`), which then reuse their factorisation; Diffrax's
    default (its `Kvaerno5` with its own root finder) with its own controller, as Diffrax's
    users get it."""
    if hasattr(dl, "PredictiveController"):
        if isinstance(solver, dl.AbstractRosenbrockW):
            return dl.PredictiveController(rtol=rtol, atol=atol, steady=(0.9, 1.2))
        # Kvaerno5 with our root finder (our BDF carries a `VeryChord` too, for its own
        # iteration, and is not a Runge-Kutta solver).
        ours_root_finder = isinstance(solver, diffrax.AbstractRungeKutta) and isinstance(
            getattr(solver, "root_finder", None), (dl.VeryChord, dl.Newton)
        )
        if isinstance(solver, (dl.Rodas5P, dl.Rodas4P)) or ours_root_finder:
            return dl.PredictiveController(rtol=rtol, atol=atol)
    if getattr(solver, "variable_order", False):
        # The variable-order BDF proposes its step through its error (and holds it for
        # q + 1 steps, as scipy and CVODE); Diffrax's PI coefficients for stiff problems
        # damp its proposals further.
        return diffrax.PIDController(rtol=rtol, atol=atol, pcoeff=0.3, icoeff=0.4)
    return diffrax.PIDController(rtol=rtol, atol=atol)


def _jax_compiled(make_solver, rhs_jnp, y0, t1, dtype=jnp.float64, device=None):
    """The jitted solve of one problem by one of ours or Diffrax's, compiled once for every
    tolerance: `rtol` and `atol` are arguments, so the controllers and root finders get them
    traced (the same steps and the same end values, bit for bit, as compiled constants).
    `dtype` and `device`: the state's (`benchmarks.stiff_device` runs float32 on an
    accelerator). Returns `(compiled, compile_s)`."""
    solver = make_solver()

    def fn(y0, rtol, atol):
        # The Rosenbrock solvers take the controller's tolerances too, for their GMRES
        # stage solves (BDF gets them through its root finder, as Diffrax's solvers).
        s = solver
        if getattr(solver, "rtol", False) is None and not hasattr(solver, "root_finder"):
            none = lambda x: x is None  # noqa: E731
            s = eqx.tree_at(lambda s: (s.rtol, s.atol), solver, (rtol, atol), is_leaf=none)
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(lambda t, y, args: rhs_jnp(y)), s, 0.0, t1, None, y0,
            stepsize_controller=controller_for(solver, rtol, atol),
            max_steps=200_000, throw=False,
        )  # fmt: skip
        return (
            sol.ys[-1],
            sol.stats["num_accepted_steps"],
            sol.stats["num_rejected_steps"],
            sol.result._value,
        )  # noqa: E501

    y0 = jax.device_put(jnp.asarray(y0, dtype), device)
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(y0, 1.0, 1.0).compile()
    return compiled, time.perf_counter() - t0


def _jax_contender(compiled, compile_s, y0, rtol, atol, dtype=jnp.float64, device=None):
    """`(call, finish, info)`: the compiled solve at these tolerances, a function of its
    output giving `(y_end, info)`, and the compile time (shared by every tolerance)."""
    y0 = jax.device_put(jnp.asarray(y0, dtype), device)
    rtol, atol = float(rtol), float(atol)

    def finish(out):
        y, acc, rej, res = out
        return np.asarray(y), {
            "accepted_steps": int(acc),
            "rejected_steps": int(rej),
            "ok": int(res) == 0,
        }

    return (lambda: compiled(y0, rtol, atol)), finish, {"compile_s": compile_s}


def _diffsl(rhs, y0, large=None):
    if large is None:
        names = [f"y{i}" for i in range(len(y0))]
        u = ",\n".join(f"{nm} = {float(v)!r}" for nm, v in zip(names, y0))
        f = ",\n".join(_S._w(e) for e in rhs([_S(nm) for nm in names]))
        return f"u_i {{\n{u}\n}}\nF_i {{\n{f}\n}}\n"
    kind, size = large
    if kind == "robertson":  # diffsol's own layout: all x, then all y, then all z
        N = size
        return (
            f"u_i {{ (0:{N}): x = 1, ({N}:{2 * N}): y = 0, ({2 * N}:{3 * N}): z = 0 }}\n"
            "F_i { -0.04 * x_i + 10000 * y_i * z_i,"
            " 0.04 * x_i - 10000 * y_i * z_i - 30000000 * y_i * y_i, 30000000 * y_i * y_i }\n"
        )
    n = size
    m = n * n
    L = _lap_matrix(n).tocoo()
    ents = ", ".join(f"({i}, {j}): {float(v)!r}" for i, j, v in zip(L.row, L.col, L.data))
    c = ", ".join(repr(float(v)) for v in bruss_y0(n))
    # `F_i { L_ij * u_j + r_i }` in one expression integrated wrongly (58 s, mescd -0.3 at
    # 16 x 16) though each term alone was right: DiffSL seems to contract j over the whole
    # expression, adding r_i once per column. Hence the separate Lu_i.
    return (
        f"L_ij {{ {ents} }}\nc_i {{ {c} }}\nu_i {{ c_i }}\n"
        f"a_i {{ u_i[0:{m}] }}\nb_i {{ u_i[{m}:{2 * m}] }}\n"
        "F_i { 1.0 + a_i * a_i * b_i - 4.4 * a_i, 3.4 * a_i - a_i * a_i * b_i } \n"
    ).replace("F_i { ", "r_i { ") + "Lu_i { L_ij * u_j }\nF_i { Lu_i + r_i }\n"


def _peer_contender(method, rhs_np, y0, t1, rtol, atol, sparsity=None, band=None, large=None):
    """`(call, finish, info)` as `_jax_contender` (info: the set-up time where there is one),
    or `(None, None, {"note": ...})`."""
    y0 = np.asarray(y0, float)
    if method.startswith("scipy"):
        kw = {"jac_sparsity": sparsity} if sparsity is not None else {}
        meth = method.split()[1]

        def fn():
            return scipy.integrate.solve_ivp(
                lambda t, y: rhs_np(y), (0.0, t1), y0, method=meth, rtol=rtol, atol=atol, **kw
            )  # noqa: E501

        def finish(sol):
            return sol.y[:, -1], {"accepted_steps": len(sol.t) - 1, "ok": bool(sol.success)}

        return fn, finish, {}
    if method.startswith("CVODE"):
        try:
            from sksundae.cvode import CVODE
        except ImportError:
            return None, None, {"note": "not installed (scikit-sundae)"}

        def f(t, y, yp):
            yp[:] = rhs_np(y)

        opts = dict(rtol=rtol, atol=atol, max_num_steps=1_000_000)
        if method == "CVODE GMRES":
            if large is None or large[0] != "brusselator":
                return None, None, {"note": "not run (unpreconditioned GMRES: Brusselator only)"}
            opts.update(linsolver="gmres")
        elif band is not None:
            opts.update(linsolver="band", lband=band, uband=band)
        elif sparsity is not None:
            opts.update(linsolver="sparse", sparsity=sparsity)
        solver = CVODE(f, **opts)

        def finish(sol):
            return sol.y[-1], {
                "accepted_steps": len(sol.t) - 1,
                "linsolver": opts.get("linsolver", "dense"),
                "ok": bool(sol.success),
            }

        return (lambda: solver.solve(np.array([0.0, t1]), y0)), finish, {}
    if method.startswith("diffsol"):
        try:
            import pydiffsol as ds
        except ImportError:
            return None, None, {"note": "not installed (pydiffsol)"}
        t0 = time.perf_counter()
        mt = ds.nalgebra_dense if len(y0) < 20 else ds.faer_sparse
        ode = ds.Ode(_diffsl(*_sym_args(rhs_np, y0, large)), matrix_type=mt)
        compile_s = time.perf_counter() - t0
        ode.ode_solver = ds.bdf if method.endswith("BDF") else ds.esdirk34
        ode.rtol, ode.atol = rtol, atol

        def finish(sol):
            y = sol.ys[:, -1]
            if large is not None and large[0] == "robertson":
                y = y.reshape(3, -1).T.reshape(-1)  # to the interleaved layout
            return y, {"accepted_steps": len(sol.ts) - 1, "ok": True}

        return (lambda: ode.solve(np.array([]), t1)), finish, {"compile_s": compile_s}
    if method == "casadi cvodes":
        try:
            import casadi as ca
        except ImportError:
            return None, None, {"note": "not installed (casadi)"}
        t0 = time.perf_counter()
        x = ca.SX.sym("x", len(y0))
        if large is None:
            ode_expr = ca.vertcat(*rhs_np.sym([x[i] for i in range(len(y0))]))
        elif large[0] == "robertson":
            X = ca.reshape(x, 3, -1)
            d1 = -0.04 * X[0, :] + 1e4 * X[1, :] * X[2, :]
            d3 = 3e7 * X[1, :] ** 2
            ode_expr = ca.reshape(ca.vertcat(d1, -d1 - d3, d3), -1, 1)
        else:
            L = _lap_matrix(large[1]).tocsc()
            Ld = ca.DM(
                ca.Sparsity(L.shape[0], L.shape[1], L.indptr.tolist(), L.indices.tolist()),
                L.data.tolist(),
            )  # noqa: E501
            m = large[1] ** 2
            a, b = x[:m], x[m:]
            ode_expr = ca.mtimes(Ld, x) + ca.vertcat(1 + a * a * b - 4.4 * a, 3.4 * a - a * a * b)
        F = ca.integrator(
            "F",
            "cvodes",
            {"x": x, "ode": ode_expr},
            0.0,
            t1,
            {"abstol": atol, "reltol": rtol, "max_num_steps": 1_000_000},
        )  # noqa: E501
        compile_s = time.perf_counter() - t0

        def finish(out):
            # `F.stats()` describes the last call; every call takes the same steps.
            st = F.stats()
            return np.asarray(out["xf"]).ravel(), {
                "accepted_steps": int(st["nsteps"]),
                "ok": bool(st.get("success", True)),
            }

        return (lambda: F(x0=y0)), finish, {"compile_s": compile_s}
    raise ValueError(method)


def _sym_args(rhs_np, y0, large):
    return (getattr(rhs_np, "sym", None), y0, large)


def _with_sym(rhs):
    def f(y):
        return np.array(rhs(y))

    f.sym = rhs
    return f


# ---- runs ----------------------------------------------------------------------------------


def _run_case(
    problem, size, rhs_jnp, rhs_np, y0, t1, ref, rtols, ratio, methods, slow_s, skip=None,
    between=(), **kw
):  # fmt: skip
    """Every contender in `methods` at every rtol: a row with its time and digits, or a row
    with a note (not installed, failed, skipped); `skip` maps contenders not run to the reason.
    The contenders of one rtol are timed interleaved (`time_round_robin`: three rounds and at
    least 0.5 s of timed solves each, a contender stopping after 20 s). `between`: rtols
    between those of `rtols` at which only the contenders of `BETWEEN_METHODS` run, timed
    by the same rule, in rows marked `between` (for `equal_accuracy`)."""
    rows, too_slow, skip = [], set(), skip or {}
    compiled = {}  # one compile per contender, for every tolerance
    for rtol in sorted({*rtols, *between}, reverse=True):
        atol = rtol * ratio
        ready, info, notes = {}, {}, {}
        inner = rtol not in rtols
        for method in [m for m in methods if m in BETWEEN_METHODS] if inner else methods:
            if method in skip:
                notes[method] = f"skipped: {skip[method]}"
                continue
            if method in too_slow:
                notes[method] = f"skipped: slower than {slow_s} s at a looser rtol"
                continue
            try:
                if method in JAX_METHODS:
                    make = _ours(method)
                    if make is None:
                        notes[method] = "not in this diffrax_linearize"
                        continue
                    if method not in compiled:
                        compiled[method] = _jax_compiled(make, rhs_jnp, y0, t1)
                    contender = _jax_contender(*compiled[method], y0, rtol, atol)
                else:
                    contender = _peer_contender(method, rhs_np, y0, t1, rtol, atol, **kw)
            except Exception as e:  # a peer failing is a result, not a crash of the benchmark
                notes[method] = _failed(e)
                continue
            call, finish, info[method] = contender
            if call is None:
                notes[method] = info[method]["note"]
            else:
                ready[method] = (call, finish)
        outputs, timings = _round_robin(ready, notes)
        for method in [m for m in methods if m in ready or m in notes]:
            base = {"problem": problem, "size": size, "rtol": rtol, "atol": atol, "method": method}
            if inner:
                base["between"] = True
            if method in notes:
                rows.append({**base, "note": notes[method]})
                continue
            try:
                y, result = ready[method][1](outputs[method])
            except Exception as e:
                rows.append({**base, "note": _failed(e)})
                continue
            row = {**base, **info[method], **timings[method], **result}
            row["mescd"] = mescd(y, ref, rtol, atol)
            if row["run_min_s"] > slow_s:
                too_slow.add(method)
            rows.append(row)
            print(
                f"  {problem} {size} rtol={rtol:g} {method}: "
                f"{row['run_min_s']:.4g} s, scd {row['mescd']:.3g}",
                flush=True,
            )
    return rows


def _failed(e: Exception) -> str:
    return f"failed: {type(e).__name__}: {str(e)[:200]}"


def _round_robin(ready, notes):
    """`time_round_robin` over the contenders set up. Where a solve raises, each contender
    is run once alone: those that raise become notes (a peer failing is a result), and the
    others are timed again without them."""
    calls = {method: call for method, (call, _) in ready.items()}
    try:
        return time_round_robin(calls, repeats=3, min_time=0.5, max_time=20.0, warmup=False)
    except Exception:
        failed = []
        for method, call in calls.items():
            try:
                call()
            except Exception as e:
                notes[method] = _failed(e)
                failed.append(method)
        if not failed:
            raise
        for method in failed:
            del ready[method]
        return _round_robin(ready, notes)


@ft.cache
def _rober_ref():
    sol = scipy.integrate.solve_ivp(
        lambda t, y: np.array(rober(y)),
        (0, 1e10),
        [1.0, 0, 0],
        method="Radau",
        rtol=1e-12,
        atol=1e-22,
    )  # noqa: E501
    return sol.y[:, -1]


def _big_rtols(quick):
    return [1e-6] if quick else [1e-4, 1e-6, 1e-8]


# The acceptance of issue 23 compares ours with the fastest of CVODE, diffsol and casadi at
# equal accuracy on the Brusselator. Two decades of rtol are two digits apart, too far to
# read ours' time at a peer's digits between them: `BETWEEN_METHODS` are also solved at
# the quarter decades between (`_between_rtols`), with the same settings and timing rule.
BETWEEN_METHODS = ("ours BDF var",)
EQUAL_ACCURACY = {
    "brusselator_2d": ("ours BDF var", ("CVODE", "CVODE GMRES", "diffsol BDF", "casadi cvodes"))
}  # noqa: E501


def _between_rtols(rtols):
    """The quarter decades strictly between the loosest and the tightest of `rtols` (decades
    of rtol), those of `rtols` left out."""
    decades = [round(-math.log10(r)) for r in rtols]
    return [
        10.0 ** -(d + k / 4)
        for d in range(min(decades), max(decades))
        for k in range(4)
        if k or d not in decades
    ]


def _test_set_case(name, quick):
    rhs, y0, t1, ref, ratio = TEST_SET[name]
    return dict(
        rhs_jnp=lambda y: jnp.stack(rhs(y)), rhs_np=_with_sym(rhs), y0=y0, t1=t1, ref=ref,
        rtols=[1e-4, 1e-6] if quick else [1e-4, 1e-5, 1e-6, 1e-7, 1e-8, 1e-9, 1e-10],
        ratio=ratio, methods=JAX_METHODS + [m for m in PEERS if m != "CVODE GMRES"],
    )  # fmt: skip


def _robertson_case(N, quick):
    from benchmarks.structure import robertson_stack

    # Diffrax's dense default: 25 s at N = 100 on the busy 2-core machine
    skip = {"diffrax default": "too slow at this size"} if N > (1 if quick else 100) else {}
    return dict(
        rhs_jnp=robertson_stack, rhs_np=rober_stack_np, y0=np.tile([1.0, 0, 0], N), t1=1e10,
        ref=np.tile(_rober_ref(), N), rtols=_big_rtols(quick), ratio=1e-2,
        methods=JAX_METHODS + PEERS, skip=skip, band=2, sparsity=rober_sparsity(N),
        large=("robertson", N),
    )  # fmt: skip


def _brusselator_case(n, quick):
    from benchmarks.structure import brusselator_2d

    y0 = bruss_y0(n)
    sp = bruss_sparsity(n)
    ref = scipy.integrate.solve_ivp(
        lambda t, y: bruss_np(y), (0, 1), y0, method="BDF", rtol=1e-11, atol=1e-13,
        jac_sparsity=sp,
    ).y[:, -1]  # fmt: skip
    # Diffrax's dense default: 42 s at 16 x 16 on the busy 2-core machine
    skip = {"diffrax default": "too slow at this size"} if quick or n > 16 else {}
    return dict(
        rhs_jnp=brusselator_2d, rhs_np=bruss_np, y0=y0, t1=1.0, ref=ref,
        rtols=_big_rtols(quick), ratio=1e-2, methods=JAX_METHODS + PEERS, skip=skip,
        sparsity=sp, large=("brusselator", n),
        between=[] if quick else _between_rtols(_big_rtols(quick)),
    )  # fmt: skip


PROBLEMS = [*TEST_SET, "robertson", "brusselator_2d"]


def cases(quick: bool = False) -> list[tuple]:
    """Every case of the sweep, in order: `(problem, size, setup)`, where `setup()` gives
    the rest of `_run_case`'s arguments (a function: a Brusselator's reference is a solve of
    its own, not made for a case that is not run)."""
    out = [
        (name, len(TEST_SET[name][1]), ft.partial(_test_set_case, name, quick))
        for name in TEST_SET
        if not quick or name in ("HIRES", "ROBER")
    ]
    out += [
        ("robertson", N, ft.partial(_robertson_case, N, quick))
        for N in ([1, 100] if quick else [1, 10, 100, 1000, 10_000])
    ]
    out += [
        ("brusselator_2d", n, ft.partial(_brusselator_case, n, quick))
        for n in ([16] if quick else [16, 32, 64])
    ]
    return out


def selection(problems=None, sizes=None, methods=None) -> Callable[..., bool]:
    """`selected(problem, size, method=None)`: whether a case (and a contender in it) is
    among those named; `None` names all."""

    def selected(problem, size, method=None):
        return (
            (problems is None or problem in problems)
            and (sizes is None or size in sizes)
            and (method is None or methods is None or method in methods)
        )

    return selected


def merge(kept: list[dict], new: list[dict], quick: bool = False) -> list[dict]:
    """The rows kept from the record and those re-run, in the order of a full sweep: by
    case, then tolerance (loosest first), then contender."""
    order = [(problem, size) for problem, size, _ in cases(quick)]
    contenders = JAX_METHODS + PEERS

    def key(r):
        case = (r["problem"], r["size"])
        return (
            order.index(case) if case in order else len(order),
            -r["rtol"],
            contenders.index(r["method"]) if r["method"] in contenders else len(contenders),
        )

    return sorted([*kept, *new], key=key)


def run(
    quick: bool = False, problems=None, sizes=None, methods=None, update: bool = False
) -> list[dict]:
    """The sweep (`quick`: its short form). `problems`, `sizes`, `methods`: only these
    cases and contenders (`None`: all). With `update`, the rows not re-run are kept from the
    recorded result, each with the date of the run that measured it (`recorded`), and the
    summary and the cost per step are recomputed from the merged rows."""
    jax.config.update("jax_enable_x64", True)
    name = "stiff_peers_quick" if quick else "stiff_peers"
    selected = selection(problems, sizes, methods)
    todo = [(p, s, setup) for p, s, setup in cases(quick) if selected(p, s)]
    if not todo:
        raise ValueError(f"no case of {name} is among problems={problems}, sizes={sizes}")
    kept, earlier, record = [], [], None
    if update:
        rerun = lambda r: selected(r["problem"], r["size"], r["method"])  # noqa: E731
        kept, earlier = kept_rows(name, rerun, carry=("peer_versions",))
        record = recorded_result(name)
    check = self_check()
    print("published references against scipy Radau (rtol 1e-12), mescd:", check)
    rows = []
    for problem, size, setup in todo:
        kw = setup()
        kw["methods"] = [m for m in kw["methods"] if selected(problem, size, m)]
        rows += _run_case(problem, size, slow_s=5.0 if quick else 30.0, **kw)
    # The loop floor is read beside the cost per step of Robertson N = 1 (`per_step`): it
    # is measured again with that case, else kept with the rows it is read beside.
    if record is not None and "loop_floor" in record and not selected("robertson", 1):
        loop_floor = record["loop_floor"]
    else:
        loop_floor = _loop_floor()
    # One date for the run and the rows it measured (`report._earlier_runs` tells the
    # older rows by theirs).
    here = machine()
    if update:
        rows = merge(kept, [{**r, "recorded": here["date"]} for r in rows], quick)
    summary = _summary(rows)
    table = markdown_table(summary, SUMMARY_COLUMNS)
    note = "quick mode: HIRES, ROBER, two tolerances, small sizes" if quick else "full sweep"
    if earlier:
        note += (
            "; a partial re-run: each row's `recorded` is the date of the run that measured "
            "it, `earlier_runs` describes the runs of the older rows (ratios between rows of "
            "different runs compare different states of the machine)"
        )
    extra = {
        "machine": here,
        "quick": quick,
        # The state of the machine, from $DIFFRAX_LINEARIZE_MACHINE_NOTE (`write_results`).
        "note": note,
        "peer_versions": _peer_versions(),
        "reference_check_mescd": check,
        "per_step": _per_step(rows),
        "equal_accuracy": equal_accuracy(rows),
        "loop_floor": loop_floor,
        "summary": summary,
        "markdown_table": table,
        **({"earlier_runs": earlier} if earlier else {}),
    }
    path = write_results(name, rows, **extra)
    print(table)
    print(f"\nResults: {path}\nPlot: {plot(rows, quick)}")
    return rows


def _peer_versions():
    import importlib.metadata as md

    out = {}
    for pkg in ("scipy", "numpy", "scikit-sundae", "pydiffsol", "casadi"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def _loop_floor(steps: int = 1000) -> dict:
    """What bounds our fixed cost per step: Diffrax's own loop, timed on Robertson (N = 1)
    with the cheapest solvers it has. `diffrax.Euler` at a constant step (one evaluation of
    f per step, no error estimate) is the floor of any `diffeqsolve` step on this machine;
    `diffrax.Heun` with `diffrax.PIDController` (two evaluations, an error estimate, the
    controller's accept/reject) that of an adaptive one. Both at a step small enough to stay
    stable, over t in [0, steps * 1e-4], timed interleaved; the number of steps is counted.
    Beside them, `steps` LAPACK LU factorisations and solves of a 3 x 3 matrix in a loop."""
    term = diffrax.ODETerm(lambda t, y, args: jnp.stack(rober(y)))
    y0 = jnp.array([1.0, 0.0, 0.0])
    t1 = steps * 1e-4

    def solve(solver, controller):
        @jax.jit
        def fn(y0):
            sol = diffrax.diffeqsolve(
                term, solver, 0.0, t1, 1e-4, y0, stepsize_controller=controller,
                max_steps=4 * steps, saveat=diffrax.SaveAt(t1=True),
            )  # fmt: skip
            return sol.ys, sol.stats["num_accepted_steps"] + sol.stats["num_rejected_steps"]

        n = int(fn(y0)[1])
        return (lambda: fn(y0)), n

    loops = {
        "Diffrax loop: Euler, constant step": solve(diffrax.Euler(), diffrax.ConstantStepSize()),
        "Diffrax loop: Heun, PIDController": solve(
            diffrax.Heun(), diffrax.PIDController(rtol=1e-6, atol=1e-8)
        ),
    }
    # And what one LAPACK LU factorisation and solve of a 3 x 3 matrix costs in an XLA
    # loop (`jax.scipy.linalg.lu_factor`, `lu_solve`: custom calls and pivot permutations),
    # against which the cost of a step that factors its matrix is to be read.
    a = jnp.eye(3) * 4.0 + 0.1

    @jax.jit
    def lu_loop(b):
        def body(i, b):
            lu = jax.scipy.linalg.lu_factor(a + 1e-3 * i)
            return jax.scipy.linalg.lu_solve(lu, b) + 0.5

        return jax.lax.fori_loop(0, steps, body, b)

    b = jnp.ones(3)
    loops["XLA loop: 3 x 3 LAPACK LU factor and solve"] = ((lambda: lu_loop(b)), steps)
    _, timings = time_round_robin({k: call for k, (call, _) in loops.items()}, repeats=7)
    return {
        name: {
            "run_min_s": timings[name]["run_min_s"],
            "steps": n,
            "s_per_step": timings[name]["run_min_s"] / n,
        }
        for name, (_, n) in loops.items()
    }


def _per_step(rows):
    """Time per step at Robertson N = 1, rtol 1e-6: the fixed cost of each loop."""
    out = {}
    for r in rows:
        fastest = r.get("run_min_s")
        if r["problem"] == "robertson" and r["size"] == 1 and r["rtol"] == 1e-6 and fastest:
            steps = r.get("accepted_steps", 0) + r.get("rejected_steps", 0)
            if steps:
                out[r["method"]] = {
                    "run_min_s": fastest,
                    "steps": steps,
                    "s_per_step": fastest / steps,
                }
    return out


SUMMARY_COLUMNS = [
    ("case", "case"), ("method", "method"), ("time", "time (fastest run)"), ("scd", "scd"),
    ("steps", "steps (acc. + rej.; peers: acc.)"), ("vs_verychord", "ours VeryChord / this"),
    ("vs_newton", "ours Newton / this"), ("note", "note"),
]  # fmt: skip


def _summary(rows):
    """One row per case and contender: the fastest run, its significant correct digits (scd,
    mescd), and the time ratios ours / this contender's (fastest runs, same case)."""
    best = {
        (r["problem"], r["size"], r["rtol"], r["method"]): r.get("run_min_s", r.get("run_s"))
        for r in rows
    }
    out = []
    # The rows between decades of rtol serve `equal_accuracy` (and the plot), not this table.
    for r in (r for r in rows if not r.get("between")):
        key = (r["problem"], r["size"], r["rtol"])
        t = r.get("run_min_s", r.get("run_s"))
        s = {
            "case": f"{r['problem']} {r['size']}, rtol {r['rtol']:g}",
            "method": r["method"],
            # With its spread where the contenders were timed interleaved (`rounds`).
            "time": fmt_spread(r) if "rounds" in r else fmt_time(t),
            "scd": f"{r['mescd']:.1f}" if r.get("mescd") is not None else "—",
            "note": r.get("note") or ("" if r.get("ok", True) else "solver reported failure"),
        }
        if "accepted_steps" in r:
            rej = r.get("rejected_steps")
            s["steps"] = (
                f"{r['accepted_steps']} + {rej}" if rej is not None else f"{r['accepted_steps']}"
            )
        for col, ours in (("vs_verychord", "ours VeryChord"), ("vs_newton", "ours Newton")):
            o = best.get((*key, ours))
            s[col] = fmt_ratio(o / t) if o is not None and t else "—"
        out.append(s)
    return out


def time_at_digits(points, digits):
    """A contender's time at `digits` significant correct digits, from its runs `points`,
    `(rtol, mescd, time)`: along its runs from the loosest rtol to the tightest, at the
    first pair of neighbours whose digits bracket `digits`, log-time interpolated linearly
    in digits (a work-precision curve is not monotone: the first crossing is the one a
    user tightening the tolerance meets). Returns `(time, how, rtols, gap)`: `how` is
    `"interpolated"` (`rtols` the pair, `gap` their digits apart), `"at most"` when the
    loosest run already has `digits` or more (its time, an upper bound; `gap` 0), or
    `None` when no run reaches `digits` (nothing is extrapolated)."""
    pts = sorted(((r, m, t) for r, m, t in points if m is not None and t), reverse=True)
    if not pts:
        return None
    if pts[0][1] >= digits:
        return pts[0][2], "at most", (pts[0][0], pts[0][0]), 0.0
    for (r0, m0, t0), (r1, m1, t1) in zip(pts, pts[1:]):
        if m0 < digits <= m1:
            w = (digits - m0) / (m1 - m0)
            t = math.exp((1 - w) * math.log(t0) + w * math.log(t1))
            return t, "interpolated", (r0, r1), m1 - m0
    return None


def equal_accuracy(rows):
    """For each case of `EQUAL_ACCURACY` and each run of its peers there: the time of ours
    at that run's digits (`time_at_digits`, over ours' runs at every rtol, the
    `between` ones included), and ours / the peer's."""
    out = []
    for r in rows:
        if r["problem"] not in EQUAL_ACCURACY or r.get("mescd") is None or r.get("between"):
            continue
        ours, peers = EQUAL_ACCURACY[r["problem"]]
        if r["method"] not in peers or not r.get("run_min_s"):
            continue
        points = [
            (o["rtol"], o.get("mescd"), o.get("run_min_s"))
            for o in rows
            if (o["problem"], o["size"], o["method"]) == (r["problem"], r["size"], ours)
        ]
        found = time_at_digits(points, r["mescd"])
        t, how, rtols, gap = found if found else (None, None, None, None)
        out.append(
            dict(
                problem=r["problem"], size=r["size"], rtol=r["rtol"], peer=r["method"],
                peer_s=r["run_min_s"], digits=r["mescd"], ours=ours, ours_s=t, how=how,
                ours_rtols=rtols, gap=gap, ratio=t / r["run_min_s"] if t else None,
            )
        )  # fmt: skip
    return out


def derive(data: dict) -> dict:
    """`data` with its summary, table and cost per step recomputed from its rows."""
    summary = _summary(data["rows"])
    return dict(
        data,
        equal_accuracy=equal_accuracy(data["rows"]),
        per_step=_per_step(data["rows"]),
        summary=summary,
        markdown_table=markdown_table(summary, SUMMARY_COLUMNS),
    )


def plot(rows, quick=False, out=None):
    cases = list(dict.fromkeys((r["problem"], r["size"]) for r in rows))
    ncol = 4
    nrow = math.ceil(len(cases) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.4 * nrow), squeeze=False)
    for ax, (problem, size) in zip(axes.ravel(), cases):
        for k, method in enumerate(dict.fromkeys(r["method"] for r in rows)):
            mine = [
                r for r in rows
                if (r["problem"], r["size"], r["method"]) == (problem, size, method) and r.get("mescd") is not None  # noqa: E501
            ]  # fmt: skip
            pts = sorted(
                (r["mescd"], r.get("run_min_s", r["run_s"])) for r in mine if not r.get("between")
            )  # noqa: E501
            color = f"C{k % 10}" if k < 10 else "k"
            if pts:
                ax.semilogy(
                    *zip(*pts),
                    "o-" if method.startswith("ours") else "s--",
                    label=method,
                    ms=4,
                    color=color,
                )  # noqa: E501
            # The runs between decades of rtol (for `equal_accuracy`): small open
            # markers off the line, so that each line still has one point a decade.
            inner = [(r["mescd"], r["run_min_s"]) for r in mine if r.get("between")]
            if inner:
                ax.semilogy(*zip(*inner), "o", ms=3, mfc="none", mew=0.6, color=color)
        ax.set_title(f"{problem} ({size})", fontsize=9)
        ax.set_xlabel("significant correct digits (mescd)", fontsize=8)
        ax.set_ylabel("time, fastest run (s)", fontsize=8)
    for ax in axes.ravel()[len(cases) :]:
        ax.axis("off")
    handles = {}
    for ax in axes.ravel()[: len(cases)]:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    spare = axes.ravel()[len(cases) :]
    (spare[0] if len(spare) else axes[0, 0]).legend(
        handles.values(), handles.keys(), fontsize=7, loc="upper left"
    )
    return save_plot(fig, "stiff_peers_quick" if quick else "stiff_peers", out, dpi=100)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--problems", nargs="+", choices=PROBLEMS, help="these problems only")
    parser.add_argument(
        "--sizes", nargs="+", type=int, help="these sizes only (unknowns; N; grid side)"
    )
    parser.add_argument(
        "--methods", nargs="+", choices=JAX_METHODS + PEERS, help="these contenders only"
    )
    ns = parse_partial_rerun(parser, argv, "problems", "sizes", "methods")
    selected = selection(ns.problems, ns.sizes, ns.methods)
    if not any(selected(p, s) for p, s, _ in cases(ns.quick)):
        parser.error("no case of the sweep has these problems and sizes")
    run(ns.quick, ns.problems, ns.sizes, ns.methods, ns.update)


if __name__ == "__main__":
    main()
