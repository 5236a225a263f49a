"""Adaptive steps for the Milstein solvers: work-precision on three SDEs whose difficulty
varies along the path. Float64; times are rough on a shared machine (ratios in one run).

Problems (all Itô, `y` in R^2, two noise channels, t in [0, 1]):

- `double well, noise burst` (commutative, diagonal): `dy = (y - y^3) dt + s(t) diag(
  sqrt(1 + y^2) / 2) dW`, with `s(t) = 0.2 + 1.5 exp(-((t - 0.5) / 0.03)^2)`: a burst of
  noise that throws paths between the wells at +-1, quiet before and after.
- `non-commutative, noise burst` (general noise): `dy = (-y + sin 4t) dt + s(t) g(y) dW` with
  `g(y)_:j = A_j y / (1 + |y|^2 / 4)^(1/2)`, `[A_1, A_2] != 0`, the same kind of burst.
- `stochastic Van der Pol, relaxation` (stiff, diagonal): Liénard form `dx = c mu (x - x^3/3
  - v) dt + s_x dW_1`, `dv = c x / mu dt + s_v sqrt(1 + v^2) dW_2`, mu = 10, c = 8,
  s_x = 0.5, s_v = 0.1, from y0 = (1.5, 1.5 - 1.5^3 / 3) on the slow branch: every path
  jumps to the other branch once, at a time of its own (between t = 0.25 and 0.59 on the
  full run's 128 reference paths), and relaxes there until t = 1. Stiff on the slow branches
  (drift eigenvalue about -c mu (x^2 - 1), -100 to -200), fast in the jump.

  Until 2026-12-05 it was c = 12, s_v = 0.3 from y0 = (2, 0.6): most paths jumped twice, the
  second time late in [0, 1], and the RMS error at t = 1 turned on the one path that jumped
  just before t = 1, which each contender of ours landed on one branch or the other as its
  step sequence changed (an error of about 3 on that path, a floor of about 0.27 in the RMS
  over 128 paths, up to steps of 2^-11 with `theta = 1`). So the errors did not fall
  steadily with the tolerance or the step, and the ratios at the target error swung from
  run to run (fixed / adaptive with the shared step 1.91x, then 0.84x, then n/a). With one
  jump well inside the interval for every path, the error at t = 1 measures the solvers,
  not that coin.

  What holds ours adaptive to small steps there (2026-12-06, a script on the full run's 128
  paths and reference, `dl.ImplicitItoMilstein` with `theta = 1`; steps and errors, not
  times): at rtol 1e-3 it takes steps of 2e-3 to 1e-2 everywhere, on the slow branches as
  in the jump, and rejects about one step in four. Its estimate reports the local error of
  the noise on the stiff x (s_x = 0.5, drift eigenvalue about -150) faithfully, but the
  stiff drift damps each such error within a few steps, so they do not add up, where the
  errors of the slow dynamics (v, and the time of the jump) do and make the error at t = 1.
  Fixed steps are about as accurate with s_x = 0.05 as with 0.5 (RMS error 0.0146 and
  0.0155 at 2^-8). With s_x = 0.05 ours adaptive at rtol 1e-3 reaches 0.0101 in 127 steps
  per path, where fixed steps need about 370 (2.9x as many); with s_x = 0.5, 0.0196 in 245,
  where fixed steps need about 204 (0.83x). So where strong noise drives the fast
  components of a stiff SDE, a local-error controller holds the step to that noise's scale
  and adaptive steps do not pay. s_x stays 0.5: a problem changed to suit the solver would
  not measure it.

Contenders, each adaptive one with the step-size controller that served it best (`CONTROLLER`,
`DIFFRAX_CONTROLLER`): ours adaptive (`diffrax.PIDController(rtol, atol=rtol, pcoeff=0.3,
icoeff=0.4)` over a range of rtol, and with Diffrax's default I-controller as a further
contender; `dl.ItoMilstein`, `dl.GeneralItoMilstein`, `dl.ImplicitItoMilstein`), ours at fixed steps
over a range of dt (the "best fixed step" at an error is read off this curve by log-log
interpolation), `diffrax.HalfSolver(ours)` adaptive (not for the general-noise solver, which
refuses it), and Diffrax's adaptive SDE solvers that apply, with the PI controller (0.1, 0.3)
that Diffrax recommends for SDEs (its only adaptive SDE solvers are Stratonovich:
`diffrax.SPaRK` and `diffrax.Heun`, given the Stratonovich drift
`f - 1/2 sum_j (dg_j/dy) g_j`, which has the same solution; Heun in the full run only.
Diffrax's IMEX `diffrax.KenCarp3` with the noise as its explicit part, which would be the
drift-implicit peer on the stiff problem, fails inside Diffrax 0.7.2 ("Closure-converted
function called with different dynamic arguments").

Brownian paths: for the commutative and the stiff problem one `diffrax.VirtualBrownianTree`
per path (with its space-time Lévy area, which SPaRK needs; our solvers read its increments),
the same tree for every contender and for the reference. The general-noise solver needs the
Lévy areas of each step, and `dl.LevyAreaBrownianPath` samples those independently per step,
not consistently across step sizes (so no adaptive solve could converge to a fixed reference
on it): here every path is instead sampled once on a fine grid (increments, Lévy areas and
space-time areas of each grid cell) and every solver's step times are rounded to that grid,
all iterated integrals over a step following by Chen's relation (`_GridPath`). That grid is
sampled outside the timed solves (so SPaRK, which reads no Lévy areas, and ours pay alike);
with `dl.LevyAreaBrownianPath` ours would also pay for sampling the areas of every step.

Reference: a very fine fixed step on the same path (2^-12 in quick mode, 2^-14 otherwise):
ours, for the double well and Van der Pol `dl.ItoTaylor15` (strong order 1.5: the Milstein
steps at the finest step are themselves about as far from the truth as SPaRK's tightest
points); checked against twice its step (`reference_check` in the JSON).

Fixed steps against SPaRK (`fixed_steps` in the JSON, and the rows "fixed / SPaRK fixed"):
SPaRK and ours (`dl.ItoMilstein` or the problem's solver, and `dl.ItoTaylor15` where it
applies) at the same fixed steps on the same paths. If SPaRK at a step h is as accurate as
ours at h / k with k larger than SPaRK's cost per step over ours, then, as far as that holds
step by step, ours on any step sequence costs more than SPaRK on the same sequence made k
times coarser: no step-size controller closes that gap, only a more accurate step.

Error: RMS over paths of |y(1) - reference(1)|. Cost per path: the fastest interleaved round
(`time_contenders`) of a jitted, `jax.vmap`ped solve of all paths, divided by the number of
paths; steps per path (accepted + rejected, mean over paths); vector-field evaluations per path
(`traced_calls`: steps times the drift and diffusion calls in one traced step, a JVP counted
as one call; an upper bound for ours, whose structure engine also calls the diffusion while
tracing, and an implicit solver's root-finder iterations count once).

Batching, and what it costs each side. Every contender solves all paths in one jitted
`jax.vmap` of `diffrax.diffeqsolve`, as a JAX user batches an ensemble (and as
`dl.solve_ensemble` does within a chunk). A vmapped adaptive solve is one `while` loop that
runs until its slowest path is done, every iteration costing the whole batch (JAX batches a
loop by masking the paths already done: jax-ml/jax#2586), so by time an adaptive contender
pays for the steps of its slowest path (`max_steps_path` in the JSON), not for the mean over
paths (`steps`); and its step times, one per path, are arrays where a fixed-step batch shares
scalar times across its paths (per-path gathers of the grid path, per-path masking of the
loop's state). The fixed-step contenders take the same steps on every path and lose neither.
This is a cost of adaptive steps in a vectorised ensemble, not of the benchmark's setup, so
the times keep it: Julia's `EnsembleThreads` runs each trajectory's loop on its own (cost: the
mean), its `EnsembleGPUArray` fuses the trajectories into one system with shared steps (cost:
the steps of the hardest path, everywhere). Solving the paths one at a time in JAX
(`jax.lax.map`, or `solve_ensemble(chunk_size=1)`) removes the lockstep but loses the
vectorisation, and on these two-unknown SDEs costs more per path than the vmapped batch
(several times more per step), so the batch is what a user would run. `dl.solve_ensemble(...,
lanes=L)` removes the lockstep and keeps the vectorisation, and was tried here as each
adaptive contender's second way to batch (hY, 2026-12-05): on these two-unknown SDEs an
iteration of L lanes costs about what an iteration of the whole vmapped batch costs, so fewer
lanes than paths take more iterations for little saving each, and as many lanes as paths take
as many iterations as the vmap; the lanes rows came out level with the vmapped ones within the
noise and doubled the run's time, so they are not kept (the `ensemble_lanes` benchmark shows
where lanes pay: paths whose step counts spread widely). The ratios by steps
per path (the mean, what each path needs on its own) are the lockstep-free comparison; the
ratio of `max_steps_path` to `steps` of an adaptive row is what the lockstep adds to its time.

One step for the whole batch ("ours adaptive, shared step", every SDE):
`diffrax_linearize.solve_ensemble(..., shared_step=True)`, which steps every path with the
solver under one `jax.vmap` over the same interval, accepts or rejects the step for all of
them at once and takes the next step size from the worst path (`diffrax.PIDController`'s
norm, the RMS, of each path's scaled error, and the largest over paths): every path is held
to the tolerances as if alone. On the paths' own trees or grid paths (the grid data passed as
per-path arrays in place of keys), so on the same paths and against the same reference as
every other contender (a test checks that at a fixed step it is the per-path solve, path for
path). Every path takes every step of the hardest path at that time, so by steps it pays
more than per-path steps would, but it pays no lockstep and no per-path step times: its loop
iteration is the fixed one's. This is Julia's `EnsembleGPUArray` way. It suits difficulty
that varies with time alike on every path (the noise burst at t = 0.5, when every path
needs small steps); on Van der Pol each path jumps at its own time, so the shared step is
small wherever any path jumps. Each path's solver runs as it would alone, so the
general-noise solver's Lévy areas stay per path (no areas between the channels of
different paths). `diffrax.SPaRK` is run the same way ("diffrax.SPaRK, shared step"), and
"Diffrax's best adaptive solver" at an error is the cheaper of its two ways to batch, for
ours per path as for ours with a shared step.

Where the time of an adaptive step goes (`--breakdown`, written as `adaptive_sde_breakdown`;
hB, 2026-12-05, rough, loaded machine). By time, fixed / adaptive at equal error is the
ratio by mean steps divided by the lockstep (`max_steps_path / steps` of the adaptive row,
about 1.23-1.25 on all three SDEs at `TARGET_RTOL`) and by the cost of an adaptive loop
iteration over a fixed one, which the breakdown splits: ours at a fixed step; the same steps
with per-path step times; the controller on a zero estimate (`_WithoutEstimate`); the
estimate too, every step accepted; adaptive at `TARGET_RTOL`. It also counts the kernels
XLA's CPU runtime launches per iteration, from the compiled program, which no load disturbs.
On the Brownian-tree SDEs the tree's descent per step (to t1: our solvers carry its value at
t0 from the step before; 16 levels at the reference's `tol`, a key split and normal samples
per level) is 93-99% of an iteration (the same SDEs on the grid path, which exposes the
solver: 9-49 us against 0.69-0.77 ms per iteration of 128 paths, 2026-12-06; with two
descents per step, as `evaluate(t0, t1)` does, 1.40-1.46 ms in the run before),
so an adaptive iteration costs what a fixed one does within
the noise; and the drift-implicit adaptive step, Newton iterations, estimate and Shampine
filter included, costs no more per iteration than the fixed one (on the grid path: level
with every step accepted, less at `TARGET_RTOL`'s smaller steps). There, 2x by time needs
about 2.5x by mean steps. On the non-commutative SDE (grid path, two unknowns) an iteration
is bound by kernel launches, not arithmetic: 33 kernels fixed, 36-38 with per-path times
(whose two row reads become per-path gathers, dearer than the shared slices), about 9 more
for the controller and 7 for the estimate (52-54); times 1.5x to 3x a fixed iteration across
runs (per-path times alone 1.2x to 1.6x; in the quietest run, on 32 paths: per-path times
1.34x, with the controller 1.62x, with the estimate 1.68x, adaptive at `TARGET_RTOL` 1.76x,
so the estimate is the smallest part by time). Even a free estimate and controller would
leave the per-path times and the lockstep, so 2x by time would need about 2 x 1.25 x (1.2 to
1.6), 3x to 4x, by mean steps, where the recorded run has 2.57x: out of reach for this
benchmark's ensemble of two-unknown paths, as for any vmapped adaptive solve whose iteration
costs launches rather than flops. Tried and not kept: reading both grid rows in one gather
(the fixed contender then gathers instead of slicing and got slower, the adaptive one level
within the noise); step-size controllers beyond those above (PI (0.3, 0.4) with
`factormax=2`, `factormin=0.5`, `safety` 0.8 or 0.95, a `dcoeff` of 0.1, PI (0.2, 0.4)),
whose ratios by steps at the target error moved within the noise of 32 paths (one path
decides the RMS error) and none better on both the double well and the non-commutative SDE.
Not tried: reusing the end-of-step drift and diffusion as the next step's (FSAL), which
could remove at most the estimate's kernels.

Acceptance ratios, per problem, at the RMS error of ours adaptive at rtol `TARGET_RTOL`:
cost(ours at the best fixed step) / cost(ours adaptive) (goal >= 2), cost(HalfSolver(ours)) /
cost(ours adaptive) (goal >= 1.5), cost(ours adaptive) / cost(Diffrax's best adaptive)
(goal <= 1); costs interpolated in log-log space between measured points (extrapolated
along the last three and flagged when the target lies outside the measured range).

    python -m benchmarks.adaptive_sde [--quick]
"""

import argparse
import math
import time

import diffrax as dfx
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optimistix as optx


jax.config.update("jax_enable_x64", True)

import diffrax_linearize as dl  # noqa: E402

from benchmarks._common import (  # noqa: E402
    fmt_ratio,
    markdown_table,
    plot_path,
    save_plot,
    time_contenders_output,
    write_results,
)


T1 = 1.0
M = 2
TARGET_RTOL = 1e-3
# Step-size controllers, each contender at its best of those tried on the quick run (PI
# (0.3, 0.4), (0.2, 0.5), Diffrax's SDE suggestion (0.1, 0.3), and the I-controllers (0, 0.7)
# and Diffrax's default (0, 1)), by steps at equal RMS error. Ours (and `HalfSolver(ours)`):
# PI (0.3, 0.4), fewest steps or within the noise of 32 paths on all three SDEs; Diffrax's
# default I-controller (kept as the contender "ours adaptive, I-controller") lets the random
# error estimates of an SDE step reject many steps and swing the step size. Diffrax's
# solvers: the insensitive PI controller (0.1, 0.3) that Diffrax's `PIDController` docs
# recommend for SDEs, which took fewer of SPaRK's steps at equal error than (0.3, 0.4) on
# the double well and the non-commutative SDE.
CONTROLLER = dict(pcoeff=0.3, icoeff=0.4)
DIFFRAX_CONTROLLER = dict(pcoeff=0.1, icoeff=0.3)
GOALS = {
    "fixed / adaptive": (">=", 2.0),
    "HalfSolver / adaptive": (">=", 1.5),
    "adaptive / Diffrax best": ("<=", 1.0),
    "adaptive 1.5 / Diffrax best": ("<=", 1.0),
    "fixed / adaptive, shared step": (">=", 2.0),
    "adaptive, shared step / Diffrax best": ("<=", 1.0),
}
ACCEPTANCE = ("fixed / adaptive", "HalfSolver / adaptive", "adaptive / Diffrax best")
# (what, numerator, denominator) of each acceptance row: costs at equal error, `None` for
# Diffrax's cheapest adaptive solver there.
RATIOS = (
    ("fixed / adaptive", "ours fixed", "ours adaptive"),
    ("HalfSolver / adaptive", "HalfSolver(ours)", "ours adaptive"),
    ("adaptive / Diffrax best", "ours adaptive", None),
    ("adaptive 1.5 / Diffrax best", "ours 1.5 adaptive", None),
    ("fixed / adaptive, shared step", "ours fixed", "ours adaptive, shared step"),
    ("adaptive, shared step / Diffrax best", "ours adaptive, shared step", None),
    ("fixed / SPaRK fixed", "ours fixed", "SPaRK fixed"),
    ("fixed 1.5 / SPaRK fixed", "ours 1.5 fixed", "SPaRK fixed"),
    ("I-controller / PI", "ours adaptive, I-controller", "ours adaptive"),
)


def _burst(t):
    return 0.2 + 1.5 * jnp.exp(-(((t - 0.5) / 0.03) ** 2))


# ---- problems ------------------------------------------------------------------------------


def _well_f(t, y, args):
    return y - y**3


def _well_g(t, y, args):
    return jnp.diag(_burst(t) * 0.5 * jnp.sqrt(1 + y**2))


_A = jnp.array([[[0.0, 1.0], [-1.0, 0.0]], [[1.0, 0.0], [0.0, -0.5]]])


def _noncomm_f(t, y, args):
    return -y + jnp.sin(4 * t)


def _noncomm_g(t, y, args):
    scale = _burst(t) / jnp.sqrt(1 + jnp.sum(y**2) / 4)
    return scale * jnp.einsum("jik,k->ij", _A, y)


VDP_MU, VDP_C, VDP_SX, VDP_SV = 10.0, 8.0, 0.5, 0.1


def _vdp_f(t, y, args):
    x, v = y[0], y[1]
    return jnp.stack([VDP_C * VDP_MU * (x - x**3 / 3 - v), VDP_C * x / VDP_MU])


def _vdp_g(t, y, args):
    return jnp.diag(jnp.stack([VDP_SX + 0 * y[0], VDP_SV * jnp.sqrt(1 + y[1] ** 2)]))


def _stratonovich(f, g):
    """The Stratonovich drift with the same solution as the Itô SDE `(f, g)`:
    `f - 1/2 sum_j (d g_:j / dy) g_:j`."""

    def drift(t, y, args):
        gy = g(t, y, args)

        def column(j):
            return jax.jvp(lambda z: g(t, z, args)[:, j], (y,), (gy[:, j],))[1]

        return f(t, y, args) - 0.5 * jnp.sum(jax.vmap(column)(jnp.arange(gy.shape[1])), axis=0)

    return drift


_NEWTON = dl.Newton(rtol=1e-8, atol=1e-8, norm=optx.max_norm, cauchy_termination=True)

PROBLEMS = {
    "double well, noise burst": dict(
        noise="commutative",
        f=_well_f,
        g=_well_g,
        y0=(-1.0, 1.0),
        ours=dl.ItoMilstein(),
        # The strong order 1.5 Itô-Taylor scheme (diagonal noise, explicit), as a further
        # contender; the acceptance ratios stay those of `ours`, with one more for it.
        ours15=dl.ItoTaylor15(),
        # The reference: strong order 1.5, where Milstein at the finest step is itself about
        # as far from the truth as SPaRK's tightest points.
        reference=dl.ItoTaylor15(),
    ),
    "non-commutative, noise burst": dict(
        noise="general", f=_noncomm_f, g=_noncomm_g, y0=(1.0, 0.5), ours=dl.GeneralItoMilstein()
    ),
    "stochastic Van der Pol, relaxation": dict(
        noise="commutative, stiff",
        f=_vdp_f,
        g=_vdp_g,
        # On the slow branch v = x - x^3 / 3, half way from x = 2 to the fold at x = 1.
        y0=(1.5, 1.5 - 1.5**3 / 3),
        # Newton: at the larger fixed steps the default `VeryChord` does not converge.
        ours=dl.ImplicitItoMilstein(root_finder=_NEWTON),
        # Diagonal noise with each sigma_i of y_i only: commutative, so the explicit order 1.5
        # scheme applies too (stable only at steps below about 2 / |c mu (x^2 - 1)|).
        ours15=dl.ItoTaylor15(),
        # The reference: strong order 1.5 and second order in the drift, stable at the
        # reference's steps (h |c mu (x^2 - 1)| below 0.1); it moves far less than the
        # trapezoidal theta = 1/2 Milstein step when its step is doubled.
        reference=dl.ItoTaylor15(),
    ),
}


# ---- the general-noise path: sampled once on a fine grid, queried by Chen's relation ------


class _GridPath(dfx.AbstractBrownianPath):
    """A Brownian path sampled on the uniform grid `k h` (increments, Lévy areas and
    space-time Lévy areas of each cell), evaluated over `[s, u]` after rounding `s` and `u`
    to the grid. With `kind="iterated"` it returns `dl.IteratedIntegrals` (ours), with
    `kind="spacetime"` a `diffrax.SpaceTimeLevyArea` (SPaRK).

    The running sums at each grid point are one row of `sums` (`_pack`), so that a query
    reads two rows: in a `jax.vmap`ped adaptive solve every path has its own step times,
    and each row read is a gather per path and step, which with `W`, the areas and the
    time integrals in three arrays were four gathers (a quarter of the time of a step of
    the general-noise solver, against two rows)."""

    h: float = eqx.field(static=True)
    kind: str = eqx.field(static=True)
    sums: jax.Array  # (n + 1, m + m^2 + m): W(t_k), A over [0, t_k], int_0^{t_k} W dr

    @property
    def t0(self):
        return 0.0

    @property
    def t1(self):
        return self.h * (self.sums.shape[0] - 1)

    @property
    def levy_area(self):
        return dl.IteratedIntegrals if self.kind == "iterated" else dfx.SpaceTimeLevyArea

    def _index(self, t):
        n = self.sums.shape[0] - 1
        return jnp.clip(jnp.round(jnp.asarray(t) / self.h).astype(jnp.int32), 0, n)

    def evaluate(self, t0, t1=None, left=True, use_levy=False):
        del left
        if t1 is None:
            t0, t1 = 0.0, t0
        i, j = self._index(t0), self._index(t1)
        # `lax.dynamic_index_in_dim` over `sums[i]`: the index is already in bounds, and
        # NumPy indexing would add a select for negative ones to every step.
        s = jax.lax.dynamic_index_in_dim(self.sums, i, keepdims=False)
        u = jax.lax.dynamic_index_in_dim(self.sums, j, keepdims=False)
        W_s, area_s, integral_s = _unpack(s)
        W_u, area_u, integral_u = _unpack(u)
        dW = W_u - W_s
        if not use_levy:
            return dW
        dt = (j - i).astype(self.sums.dtype) * self.h
        if self.kind == "iterated":
            area = area_u - area_s - 0.5 * (jnp.outer(W_s, dW) - jnp.outer(dW, W_s))
            return dl.IteratedIntegrals(dt=dt, W=dW, A=area)
        # h H = int_s^u (W_r - W_s) dr - h dW / 2
        safe = jnp.where(dt > 0, dt, 1.0)
        H = (integral_u - integral_s - dt * W_s) / safe - 0.5 * dW
        return dfx.SpaceTimeLevyArea(dt=dt, W=dW, H=jnp.where(dt > 0, H, 0.0))


def _pack(W, area, integral):
    """The rows `[W, A (flattened), int W dr]` of `_GridPath.sums`."""
    flat = area.reshape(area.shape[:-2] + (M * M,))
    return jnp.concatenate([W, flat, integral], axis=-1)


def _unpack(row):
    return row[:M], row[M : M + M * M].reshape(M, M), row[M + M * M :]


def _grid_data(key, n: int):
    """The rows of `_GridPath.sums`: running sums of the increments, Lévy areas
    (conditional on the increments) and space-time Lévy areas (independent of them) of
    the `n` cells of `[0, T1]`, sampled from `key`. Within one cell
    the area is not correlated with the space-time area as for a Brownian motion; over a
    step of k cells that misses a fraction of about k^(-1/2) of the joint law."""
    h = T1 / n
    k_w, k_a, k_h = jr.split(key, 3)
    dW = math.sqrt(h) * jr.normal(k_w, (n, M))
    n_terms = dl.levy_area_n_terms(M, h)
    areas = jax.vmap(lambda k, w: dl.sample_levy_area(k, w, h, n_terms))(jr.split(k_a, n), dW)
    H = math.sqrt(h / 12) * jr.normal(k_h, (n, M))
    return _grid_sums(h, dW, areas, H)


def _grid_sums(h, dW, areas, H):
    """The running sums of `_GridPath` (`_pack`ed) from the increments, Lévy areas and
    space-time Lévy areas of the cells."""
    n = dW.shape[0]
    grid = dl.GridLevyAreaPath(jnp.linspace(0.0, h * n, n + 1), dW, areas)
    cell_integral = h * (grid.W[:-1] + 0.5 * dW + H)
    integral = jnp.concatenate([jnp.zeros((1, dW.shape[1])), jnp.cumsum(cell_integral, axis=0)])
    return _pack(grid.W, grid.area, integral)


# ---- contenders ----------------------------------------------------------------------------


class _ImplicitHalfSolver(dfx.HalfSolver):
    """`diffrax.HalfSolver` of an implicit solver: Diffrax 0.7.2's `diffeqsolve` treats the
    wrapper as implicit and looks up its `root_finder` (an `AttributeError` otherwise)."""

    @property
    def root_finder(self):
        return self.solver.root_finder


def _contenders(problem: dict, quick: bool) -> dict[str, dict]:
    """name -> {solver, ito (which drift), adaptive, path kind}."""
    ours = problem["ours"]
    general = problem["noise"] == "general"
    pi = dict(controller=CONTROLLER)
    out = {
        "ours adaptive": dict(solver=ours, ito=True, adaptive=True, **pi),
        "ours adaptive, I-controller": dict(solver=ours, ito=True, adaptive=True),
        "ours fixed": dict(solver=ours, ito=True, adaptive=False),
    }
    # The batch as one system with one step for every path (`_make_shared_solve`); on Van der
    # Pol, whose paths jump at different times, its steps grow fast with the tolerance: the
    # looser tolerances only.
    shared_params = [1e-1, 3e-2, 1e-2, 3e-3, 1e-3] if "stiff" in problem["noise"] else None
    out["ours adaptive, shared step"] = dict(
        solver=ours, ito=True, adaptive=True, shared=True, params=shared_params, **pi
    )
    if "ours15" in problem:
        # Diffrax's SDE controller: fewer steps at equal error than (0.3, 0.4) for it.
        ctrl = dict(controller=DIFFRAX_CONTROLLER)
        out["ours 1.5 adaptive"] = dict(solver=problem["ours15"], ito=True, adaptive=True, **ctrl)
        out["ours 1.5 fixed"] = dict(solver=problem["ours15"], ito=True, adaptive=False)
    if not general:
        implicit = isinstance(ours, dfx.AbstractImplicitSolver)
        half = _ImplicitHalfSolver if implicit else dfx.HalfSolver
        out["HalfSolver(ours)"] = dict(solver=half(ours), ito=True, adaptive=True, **pi)
    peer = dict(controller=DIFFRAX_CONTROLLER)
    out["diffrax.SPaRK"] = dict(solver=dfx.SPaRK(), ito=False, adaptive=True, **peer)
    # At fixed steps too, on the same paths: how much more accurate SPaRK's step is than ours
    # at the same step, against how much more it costs (`fixed_steps`).
    out["SPaRK fixed"] = dict(solver=dfx.SPaRK(), ito=False, adaptive=False)
    # SPaRK on the batch as one system too, so that Diffrax's best adaptive solver at an error
    # is the cheaper of its two ways to batch, as ours' is.
    out["diffrax.SPaRK, shared step"] = dict(
        out["diffrax.SPaRK"], shared=True, params=shared_params
    )
    if not quick:
        out["diffrax.Heun"] = dict(solver=dfx.Heun(), ito=False, adaptive=True, **peer)
    return out


def path_inputs(problem: dict, keys, n_ref: int, grid: bool = False):
    """What `_make_solve`'s solves take for the paths: the keys of the Brownian trees, or for
    general noise (or with `grid`) the grid data, sampled here once, outside the timed
    solves, so that every contender reads the same arrays."""
    if problem["noise"] != "general" and not grid:
        return keys
    return jax.jit(jax.vmap(lambda k: _grid_data(k, n_ref)))(keys)


def _make_solve(
    problem: dict, contender: dict, n_ref: int, max_steps: int, param_axis: int | None = None
):
    """`solve(paths, param) -> (y(1), steps, ok)` over a batch of paths: `paths` the keys of
    the Brownian trees, or for general noise the grid data of `_grid_data` (sampled outside
    the timed solve); `param` is rtol for an adaptive contender and dt for a fixed one, one
    for all paths (or one per path with `param_axis=0`). An adaptive contender's
    `controller` options override the tolerances and `dtmin`; its `dt0` is Diffrax's
    automatic first step unless it names one."""
    if contender.get("shared"):
        return _make_shared_solve(problem, contender, n_ref, max_steps)
    y0 = jnp.asarray(problem["y0"])

    def one(key, param):
        terms = _terms(problem, contender, n_ref, key)
        dtmin = _dtmin(problem, contender, n_ref)
        sol = _diffeqsolve(terms, contender, param, y0, max_steps, dtmin=dtmin)
        return sol.ys[-1], sol.stats["num_steps"], sol.result == dfx.RESULTS.successful

    return jax.vmap(one, in_axes=(0, param_axis))


def _grid(problem: dict, contender: dict) -> bool:
    # The grid path for general noise, and wherever a contender asks for it (`breakdown`).
    return problem["noise"] == "general" or contender.get("grid", False)


def _dtmin(problem: dict, contender: dict, n_ref: int) -> float | None:
    # Steps no shorter than the grid's cells, on the grid path.
    return T1 / n_ref if _grid(problem, contender) else None


def _terms(problem: dict, contender: dict, n_ref: int, path):
    """The terms of one path of `problem` for `contender`: the Itô or the Stratonovich drift,
    and the path's Brownian tree (`path` its key) or grid path (`path` its grid data)."""
    f = problem["f"] if contender["ito"] else _stratonovich(problem["f"], problem["g"])
    if _grid(problem, contender):
        kind = "iterated" if contender["ito"] else "spacetime"
        bm = _GridPath(T1 / n_ref, kind, path)
    else:
        bm = _tree(path, n_ref)
    return dfx.MultiTerm(dfx.ODETerm(f), dfx.ControlTerm(problem["g"], bm))


def _stepping(contender: dict, param, **options):
    """`(stepsize_controller, dt0)` of a contender: adaptive at rtol = atol = `param` with
    `diffrax.PIDController(**options)` and the contender's `controller` options over them
    (its `dt0`, else Diffrax's automatic first step), or the fixed step `param`."""
    if contender["adaptive"]:
        options = dict(options, rtol=param, atol=param)
        controller = dfx.PIDController(**{**options, **contender.get("controller", {})})
        return controller, contender.get("dt0")
    return dfx.ConstantStepSize(), param


def _diffeqsolve(terms, contender: dict, param, y0, max_steps: int, **options):
    """One solve over `[0, T1]` of `contender["solver"]`, stepped as `_stepping` says."""
    controller, dt0 = _stepping(contender, param, **options)
    return dfx.diffeqsolve(
        terms,
        contender["solver"],
        0.0,
        T1,
        dt0,
        y0,
        stepsize_controller=controller,
        max_steps=max_steps,
        throw=False,
    )


def _tree(key, n_ref: int) -> dfx.VirtualBrownianTree:
    return dfx.VirtualBrownianTree(
        0.0, T1, tol=T1 / (4 * n_ref), shape=(M,), key=key, levy_area=dfx.SpaceTimeLevyArea
    )


def _make_shared_solve(problem: dict, contender: dict, n_ref: int, max_steps: int):
    """As `_make_solve`, for the contenders that solve the whole batch with one step size
    for every path: `diffrax_linearize.solve_ensemble(..., shared_step=True)` (the solver's
    step `jax.vmap`ped over the paths, the step accepted or rejected and the next one chosen
    for all of them at once, the controller's norm of each path's error and the largest
    taken), on the same Brownian trees or grid paths as the per-path contenders (the grid
    data passed as per-path arrays in place of keys), so against the same reference. Every
    path then takes the same steps, with scalar step times, as at fixed steps, and the loop
    ends when the batch is done."""
    y0 = jnp.asarray(problem["y0"])

    def solve(paths, param):
        controller, dt0 = _stepping(contender, param, dtmin=_dtmin(problem, contender, n_ref))
        sol = dl.solve_ensemble(
            lambda path: _terms(problem, contender, n_ref, path[0]),
            contender["solver"],
            0.0,
            T1,
            dt0,
            y0,
            keys=(paths,),
            shared_step=True,
            saveat=dfx.SaveAt(t1=True),
            reductions=(),
            stepsize_controller=controller,
            max_steps=max_steps,
            throw=False,
        )
        ok = sol.paths.result == dfx.RESULTS.successful
        return sol.paths.ys[:, -1], sol.paths.stats["num_steps"], ok

    return solve


def _calls_per_step(problem: dict, contender: dict) -> int:
    """Drift and diffusion calls in one traced step (a JVP of a call counts as one; so do
    the calls the structure engine makes while tracing, which are not run)."""
    count = [0]

    def counted(fn):
        def wrapped(*a):
            count[0] += 1
            return fn(*a)

        return wrapped

    f = problem["f"] if contender["ito"] else _stratonovich(problem["f"], problem["g"])
    f, g = counted(f), counted(problem["g"])
    y0 = jnp.asarray(problem["y0"])
    solver = contender["solver"]
    if problem["noise"] == "general":
        n = 16
        kind = "iterated" if contender["ito"] else "spacetime"
        bm = _GridPath(T1 / n, kind, _grid_data(jr.key(0), n))
    else:
        bm = dfx.VirtualBrownianTree(
            0.0, T1, tol=1e-3, shape=(M,), key=jr.key(0), levy_area=dfx.SpaceTimeLevyArea
        )
    terms = dfx.MultiTerm(dfx.ODETerm(f), dfx.ControlTerm(g, bm))

    def step(y0):
        state = solver.init(terms, 0.0, 0.125, y0, None)
        return solver.step(terms, 0.0, 0.125, y0, None, state, False)[0]

    jax.eval_shape(step, y0)
    return count[0]


# ---- work-precision ------------------------------------------------------------------------


def _cost_at(errors, costs, target):
    """Cost at `target` error, interpolated in log-log space between measured points (or
    extrapolated along a least-squares line through the nearest three, flagged; `None`
    where that line's slope is not that of a convergent method, of order between 1/4 and 4:
    two points of almost equal error, as when one path's error dominates, would otherwise
    extrapolate to any cost)."""
    pts = [(e, c) for e, c in zip(errors, costs) if e and c and np.isfinite(e) and e > 0]
    if len(pts) < 2:
        return None, True
    le, lc = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
    order = np.argsort(le)
    le, lc = le[order], lc[order]
    lt = math.log(target)
    if le[0] <= lt <= le[-1]:
        return float(np.exp(np.interp(lt, le, lc))), False
    sel = slice(0, 3) if lt < le[0] else slice(-3, None)
    slope, intercept = np.polyfit(le[sel], lc[sel], 1)
    if not 0.25 <= abs(slope) <= 4:
        return None, True
    return float(np.exp(intercept + slope * lt)), True


def _params(adaptive: bool, quick: bool) -> list[float]:
    if adaptive:
        return [1e-1, 3e-2, 1e-2, 3e-3, 1e-3] + ([] if quick else [3e-4, 1e-4])
    return [2.0**-k for k in range(3, 10 if quick else 12)]


def _run_problem(name: str, problem: dict, quick: bool) -> tuple[list[dict], dict]:
    n_paths = 32 if quick else 128
    n_ref = 2**12 if quick else 2**14
    keys = path_inputs(problem, jr.split(jr.key(sum(map(ord, name))), n_paths), n_ref)
    contenders = _contenders(problem, quick)
    solves = {
        c: _make_solve(problem, spec, n_ref, max_steps=n_ref) for c, spec in contenders.items()
    }
    # The reference: ours at the finest fixed step (the same compiled solve as "ours fixed",
    # unless the problem names another solver), and at twice that step for its own error.
    if "reference" in problem:
        spec = dict(contenders["ours fixed"], solver=problem["reference"])
        fixed = jax.jit(_make_solve(problem, spec, n_ref, max_steps=n_ref))
    else:
        fixed = jax.jit(solves["ours fixed"])
    reference, _, ok = fixed(keys, T1 / n_ref)
    half_ref, _, _ = fixed(keys, 2 * T1 / n_ref)
    ref_check = float(jnp.sqrt(jnp.mean(jnp.sum((half_ref - reference) ** 2, axis=-1))))
    assert bool(jnp.all(ok)), name
    fns = {}
    for c, spec in contenders.items():
        for p in spec.get("params") or _params(spec["adaptive"], quick):
            fns[(c, p)] = (solves[c], (keys, p))
    labelled = {f"{c} @ {p:g}": fn for (c, p), fn in fns.items()}
    outputs, times = time_contenders_output(
        labelled, repeats=3 if quick else 7, max_time=10.0 if quick else 30.0
    )
    calls = {c: _calls_per_step(problem, spec) for c, spec in contenders.items()}
    rows = []
    for (c, p), label in zip(fns, labelled):
        ys, steps, ok = outputs[label]
        t = times[label]
        err = float(jnp.sqrt(jnp.mean(jnp.sum((ys - reference) ** 2, axis=-1))))
        mean_steps = float(jnp.mean(steps))
        rows.append(
            dict(
                problem=name,
                noise=problem["noise"],
                method=c,
                solver=type(contenders[c]["solver"]).__name__,
                adaptive=contenders[c]["adaptive"],
                param=p,
                param_kind="rtol = atol" if contenders[c]["adaptive"] else "dt",
                rms_error=err,
                failed_paths=int(n_paths - int(jnp.sum(ok))),
                steps=mean_steps,
                max_steps_path=int(jnp.max(steps)),
                traced_calls_per_step=calls[c],
                traced_calls=mean_steps * calls[c],
                time_per_path_s=t["run_min_s"] / n_paths,
                run_min_s=t["run_min_s"],
                run_s=t["run_s"],
                run_max_s=t["run_max_s"],
                compile_s=t["compile_s"],
                rounds=t["rounds"],
                n_paths=n_paths,
            )
        )
    return rows, dict(
        problem=name, n_ref=n_ref, n_paths=n_paths, reference_check=ref_check, calls=calls
    )


def acceptance(rows: list[dict], rtol: float = TARGET_RTOL) -> list[dict]:
    """Per problem, at the RMS error of ours adaptive at `rtol` (`TARGET_RTOL`, the
    acceptance's): the cost ratios of the acceptance criteria, by time per path and by
    steps per path."""
    out = []
    for problem in dict.fromkeys(r["problem"] for r in rows):
        sel = [r for r in rows if r["problem"] == problem and not r["failed_paths"]]
        by_method: dict[str, list[dict]] = {}
        for r in sel:
            by_method.setdefault(r["method"], []).append(r)
        ours = [r for r in by_method.get("ours adaptive", []) if r["param"] == rtol]
        if not ours:
            continue
        target = ours[0]["rms_error"]

        def cost(method, key):
            pts = by_method.get(method)
            if not pts:
                return None, False
            return _cost_at([r["rms_error"] for r in pts], [r[key] for r in pts], target)

        peers = [m for m in by_method if m.startswith("diffrax.")]
        for what, num, den in RATIOS:
            # The criteria of ours adaptive keep their row (n/a) without a contender; the
            # further comparisons only appear where both sides ran.
            missing = num not in by_method or (den is not None and den not in by_method)
            if missing and what not in ACCEPTANCE:
                continue
            row = dict(problem=problem, what=what, rms_error=target)
            for key, col in (("time_per_path_s", "time_ratio"), ("steps", "steps_ratio")):
                top, top_extrapolated = cost(num, key)
                if top is None:
                    continue
                if den is None:
                    theirs = {m: cost(m, key) for m in peers}
                    theirs = {m: v for m, v in theirs.items() if v[0] is not None}
                    if not theirs:
                        continue
                    den_name = min(theirs, key=lambda m: theirs[m][0])
                    row[f"{col}_vs"] = den_name
                    bottom, extrapolated = theirs[den_name]
                else:
                    bottom, extrapolated = cost(den, key)
                    if bottom is None:
                        continue
                row[col] = top / bottom
                row[f"{col}_extrapolated"] = extrapolated or top_extrapolated
            if what not in GOALS:
                row["goal"] = "—"
                out.append(row)
                continue
            op, bound = GOALS[what]
            row["goal"] = f"{op} {bound:g}"
            if "time_ratio" in row:
                r = row["time_ratio"]
                row["met"] = bool(r >= bound if op == ">=" else r <= bound)
            out.append(row)
    return out


def fixed_steps(rows: list[dict]) -> list[dict]:
    """Per problem and fixed step `dt`: SPaRK's RMS error at `dt` on the same paths as ours,
    the step `dt / k` at which ours at fixed steps has that error (log-log interpolation),
    and SPaRK's cost per step over ours' at `dt` (time per path; traced calls). If `k`
    exceeds the cost ratio, SPaRK at a step is as accurate as ours at a `k` times smaller
    one for less than `k` times the cost, and, as far as that holds step by step, no step
    sequence the controller picks for ours matches SPaRK's cost on the same sequence
    scaled by `k` (`spark_cheaper_by = k / cost ratio`, above 1)."""
    out = []
    for problem in dict.fromkeys(r["problem"] for r in rows):
        ok = [
            r
            for r in rows
            if r["problem"] == problem
            and not r["adaptive"]
            and not r["failed_paths"]
            and math.isfinite(r["rms_error"])
        ]
        by_method: dict[str, dict[float, dict]] = {}
        for r in ok:
            by_method.setdefault(r["method"], {})[r["param"]] = r
        spark = by_method.get("SPaRK fixed", {})
        for ours in ("ours fixed", "ours 1.5 fixed"):
            mine = by_method.get(ours)
            if not mine or len(mine) < 2:
                continue
            errs, dts = [r["rms_error"] for r in mine.values()], list(mine)
            for dt, r in sorted(spark.items(), reverse=True):
                dt_equal, extrapolated = _cost_at(errs, dts, r["rms_error"])
                row = dict(
                    problem=problem,
                    ours=ours,
                    dt=dt,
                    spark_error=r["rms_error"],
                    ours_error=mine[dt]["rms_error"] if dt in mine else None,
                    k=dt / dt_equal if dt_equal else None,
                    k_extrapolated=extrapolated,
                )
                if dt in mine:
                    cost = r["time_per_path_s"] / mine[dt]["time_per_path_s"]
                    row["cost_per_step_ratio"] = cost
                    row["calls_per_step_ratio"] = (
                        r["traced_calls_per_step"] / mine[dt]["traced_calls_per_step"]
                    )
                    if row["k"] is not None:
                        row["spark_cheaper_by"] = row["k"] / cost
                out.append(row)
    return out


def fixed_table(fixed: list[dict]) -> str:
    cells = [
        dict(
            problem=f["problem"],
            ours=f["ours"],
            dt=f"2^{round(math.log2(f['dt']))}",
            spark=f"{f['spark_error']:.2g}",
            k=(f"{f['k']:.3g}" + (" *" if f["k_extrapolated"] else "")) if f["k"] else "n/a",
            cost=fmt_ratio(f.get("cost_per_step_ratio")) if "cost_per_step_ratio" in f else "n/a",
            cheaper=fmt_ratio(f.get("spark_cheaper_by")) if "spark_cheaper_by" in f else "n/a",
        )
        for f in fixed
    ]
    columns = [
        ("problem", "SDE"),
        ("ours", "ours"),
        ("dt", "dt"),
        ("spark", "SPaRK RMS error"),
        ("k", "k: ours needs dt / k"),
        ("cost", "SPaRK / ours per step"),
        ("cheaper", "k / cost per step"),
    ]
    return markdown_table(cells, columns)


def over_tolerances(rows: list[dict]) -> list[dict]:
    """The acceptance criteria (`ACCEPTANCE`) read at the RMS error of ours adaptive at each
    of its tolerances, not only at `TARGET_RTOL`'s: per problem and criterion, `cells`
    maps each rtol (as text, `f"{rtol:g}"`: JSON keys are strings) to `{rms_error,
    time_ratio, extrapolated, met}` (`None` where the ratio has no value there). Where a
    goal holds depends on the error asked for: this shows the whole range measured."""
    rtols = sorted(
        {r["param"] for r in rows if r["method"] == "ours adaptive" and not r["failed_paths"]},
        reverse=True,
    )
    out: dict[tuple[str, str], dict] = {}
    for rtol in rtols:
        for a in acceptance(rows, rtol):
            if a["what"] not in ACCEPTANCE:
                continue
            entry = out.setdefault(
                (a["problem"], a["what"]),
                dict(problem=a["problem"], what=a["what"], goal=a["goal"], cells={}),
            )
            entry["cells"][f"{rtol:g}"] = (
                dict(
                    rms_error=a["rms_error"],
                    time_ratio=a["time_ratio"],
                    extrapolated=a["time_ratio_extrapolated"],
                    met=a["met"],
                )
                if "time_ratio" in a
                else None
            )
    return list(out.values())


def over_tolerances_table(entries: list[dict]) -> str:
    """`over_tolerances` as a table: a row per problem and tolerance of ours adaptive, with
    the RMS error the ratios are read at and a column per criterion, each the ratio by
    time (bold where the goal holds; * extrapolated)."""
    whats = list(dict.fromkeys(e["what"] for e in entries))
    goals = {e["what"]: e["goal"] for e in entries}
    by = {(e["problem"], e["what"]): e["cells"] for e in entries}
    cells = []
    for problem in dict.fromkeys(e["problem"] for e in entries):
        rtols = {t for w in whats for t in by.get((problem, w), {})}
        for t in sorted(rtols, key=float, reverse=True):
            found = {w: by.get((problem, w), {}).get(t) for w in whats}
            errors = [c["rms_error"] for c in found.values() if c is not None]
            row = dict(problem=problem, rtol=t, error=f"{errors[0]:.2g}" if errors else "—")
            for w, c in found.items():
                if c is None:
                    row[w] = "n/a"
                    continue
                ratio = fmt_ratio(c["time_ratio"])
                row[w] = (f"**{ratio}**" if c["met"] else ratio) + (
                    " *" if c["extrapolated"] else ""
                )
            cells.append(row)
    columns = [("problem", "SDE"), ("rtol", "rtol"), ("error", "RMS error")]
    columns += [(w, f"{w} ({goals[w]})") for w in whats]
    return markdown_table(cells, columns)


OVER_TOLERANCES_NOTE = (
    "The same three criteria at the RMS error of ours adaptive at each of its tolerances "
    "(the table above reads them at rtol 1e-3's), by time per path, bold where the goal "
    "holds. n/a: as above."
)


def table(acc: list[dict]) -> str:
    cells = []
    for a in acc:
        star = lambda k: " *" if a.get(f"{k}_extrapolated") else ""  # noqa: E731
        cells.append(
            dict(
                problem=a["problem"],
                what=a["what"] + (f" ({a['time_ratio_vs']})" if a.get("time_ratio_vs") else ""),
                at=f"{a['rms_error']:.2g}",
                time=fmt_ratio(a.get("time_ratio")) + star("time_ratio")
                if "time_ratio" in a
                else "n/a",
                steps=fmt_ratio(a.get("steps_ratio")) + star("steps_ratio")
                if "steps_ratio" in a
                else "n/a",
                goal=a["goal"],
                met={True: "yes", False: "no", None: "—"}[a.get("met")],
            )
        )
    columns = [
        ("problem", "SDE"),
        ("what", "ratio"),
        ("at", "at RMS error"),
        ("time", "by time per path"),
        ("steps", "by steps per path"),
        ("goal", "goal (by time)"),
        ("met", "met"),
    ]
    return markdown_table(cells, columns)


TABLE_NOTE = (
    "Ratios by the fastest round of time per path, and by steps per path (accepted + "
    "rejected; a step of `HalfSolver(ours)` is three steps of ours); the first two are "
    "another's cost over ours adaptive (above 1: ours adaptive is cheaper), the last ours "
    "adaptive over Diffrax's cheapest adaptive solver at that error (below 1: ours is "
    "cheaper). By time, each contender's paths are solved in one `jax.vmap`ped solve: an "
    "adaptive one runs until its slowest path is done, every iteration costing the whole "
    "batch, so it pays for the steps of its slowest path (`max_steps_path` in the JSON) where "
    "the steps per path are the mean over paths; fixed steps are the same on every path. "
    "n/a: fewer than two tolerances of that contender solved every path (a failed "
    "root find inside `diffrax.HalfSolver` ends the solve), or there is no such contender "
    "(`HalfSolver` refuses the general-noise solvers), or the error lies outside the "
    "contender's measured errors and the line through its nearest three points is not "
    "that of a convergent method (its errors level off: `_cost_at`). * : extrapolated "
    'along that line. "adaptive 1.5": `ItoTaylor15` '
    'adaptive, where it applies. "fixed / SPaRK fixed": ours over SPaRK, both at fixed '
    "steps, on the same paths (above 1: at fixed steps SPaRK's step buys its accuracy "
    "more cheaply than ours; `fixed_steps` in the JSON has it step by step). The last line "
    "of each SDE: ours with Diffrax's default I-controller over ours with its PI "
    'controller. "shared step": ours adaptive with one step size for the whole batch '
    "(`solve_ensemble(..., shared_step=True)`: each path's RMS error norm, the largest "
    "taken), on the same paths (a fixed cost per iteration, no lockstep), and SPaRK "
    "likewise; Diffrax's best "
    "is the cheapest of its adaptive contenders, per path or shared step. Where an error "
    "comes within a few times the reference's own (its change when its step is doubled, "
    "`references` in the JSON), it is partly the reference's."
)


def derive(data: dict) -> dict:
    acc = acceptance(data["rows"])
    sweep = over_tolerances(data["rows"])
    return dict(
        data,
        acceptance=acc,
        markdown_table=table(acc),
        over_tolerances=sweep,
        over_tolerances_table=over_tolerances_table(sweep),
    )


def run(quick: bool = False) -> list[dict]:
    rows, checks = [], []
    name = "adaptive_sde_quick" if quick else "adaptive_sde"
    start = time.perf_counter()
    for problem_name, problem in PROBLEMS.items():
        r, check = _run_problem(problem_name, problem, quick)
        rows += r
        checks.append(check)
        print(f"{problem_name}: reference vs half its step {check['reference_check']:.2g}")
        # What is measured so far, in case a later problem fails.
        write_results(name, rows, quick=quick, partial=True, references=checks)
    acc = acceptance(rows)
    print(
        markdown_table(
            rows,
            [
                ("problem", "SDE"),
                ("method", "method"),
                ("param", "rtol or dt"),
                ("rms_error", "RMS error"),
                ("steps", "steps / path"),
                ("traced_calls", "f, g calls / path (traced)"),
                ("time_per_path_s", "time / path"),
                ("failed_paths", "failed"),
            ],
        )
    )
    print()
    print(table(acc))
    fixed = fixed_steps(rows)
    print()
    print(fixed_table(fixed))
    # The state of the machine comes from $DIFFRAX_LINEARIZE_MACHINE_NOTE (`write_results`).
    note = "quick mode: fewer paths and tolerances" if quick else "full run"
    path = write_results(
        name,
        rows,
        quick=quick,
        note=note,
        target_rtol=TARGET_RTOL,
        total_s=time.perf_counter() - start,
        references=checks,
        acceptance=acc,
        markdown_table=table(acc),
        fixed_steps=fixed,
        fixed_steps_table=fixed_table(fixed),
    )
    print(f"\nwrote {path}")
    print(f"wrote {plot(rows, out=plot_path(name))}")
    return rows


# ---- where the time of an adaptive loop iteration goes --------------------------------------


class _WithoutEstimate(dfx.AbstractAdaptiveSolver, dfx.AbstractWrappedSolver):
    """`solver`, its error estimate replaced by zeros: with a step-size controller, the
    controller's work without the estimate's (which the compiler then drops). Not a
    `diffrax.HalfSolver`, which the general-noise solvers refuse."""

    solver: dfx.AbstractSolver

    @property
    def term_structure(self):
        return self.solver.term_structure

    @property
    def interpolation_cls(self):  # pyright: ignore
        return self.solver.interpolation_cls

    @property
    def term_compatible_contr_kwargs(self):
        return self.solver.term_compatible_contr_kwargs

    @property
    def root_finder(self):
        # Diffrax 0.7.2's `diffeqsolve` looks it up on an implicit solver's wrapper.
        return self.solver.root_finder

    def order(self, terms):
        return self.solver.order(terms)

    def strong_order(self, terms):
        return self.solver.strong_order(terms)

    def error_order(self, terms):
        return self.solver.error_order(terms)

    def init(self, terms, t0, t1, y0, args):
        return self.solver.init(terms, t0, t1, y0, args)

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        y1, y_error, dense, state, result = self.solver.step(
            terms, t0, t1, y0, args, solver_state, made_jump
        )
        return y1, jax.tree.map(jnp.zeros_like, y_error), dense, state, result

    def func(self, terms, t0, y0, args):
        return self.solver.func(terms, t0, y0, args)


BREAKDOWN_DT = 2.0**-7
# What each variant adds to the one before it (`breakdown`).
BREAKDOWN = (
    ("fixed", "ours at a fixed step, its step times shared by the whole batch"),
    ("fixed, per-path times", "the same steps with `dt0` given per path: every time an array"),
    ("adaptive, controller only", "PIDController on a zero error estimate, the step capped"),
    ("adaptive, all accepted", "PIDController, tolerances so loose that every step is accepted"),
    ("adaptive", f"PIDController at rtol = atol = {TARGET_RTOL:g}, as in the work-precision rows"),
)


def _loop_kernels(compiled_text: str) -> int | None:
    """The instructions that XLA's CPU runtime runs one after another in each iteration of
    the solve's outer `while` loop (its body and condition, fused computations counted
    once, an inner loop counted once), from the compiled program's text: a count that no
    load on the machine disturbs. `None` where the text has no loop."""
    import re

    computations, current = {}, None
    for line in compiled_text.split("\n"):
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$", line)
        if head:
            current = computations.setdefault(head.group(1), [])
        elif current is not None and line.strip() not in ("", "}"):
            current.append(line.strip())
    entry = re.search(r"^ENTRY %?([\w.\-]+)", compiled_text, re.M)
    loop = r" while\([^)]*\), condition=%([\w.\-]+), body=%([\w.\-]+)"

    def outer_loops(name):
        # XLA's CPU backend may wrap a small loop in a `call` of its own.
        for line in computations.get(name, []):
            yield from re.finditer(loop, line)
            if " call(" in line and (callee := re.search(r"to_apply=%([\w.\-]+)", line)):
                yield from outer_loops(callee.group(1))

    found = list(outer_loops(entry.group(1)))
    if len(found) != 1:
        return None
    free = ("parameter", "get-tuple-element", "tuple", "bitcast", "constant")
    count = 0
    for name in found[0].groups():
        for line in computations.get(name, []):
            # The type is one shape, or a tuple of them in parentheses (a loop's).
            op = re.match(r"(?:ROOT )?%[\w.\-]+ = (?:\([^)]*\)|\S+) ([\w\-]+)\(", line)
            if op and op.group(1) in ("while", "call", "conditional"):
                # An inner loop (the Brownian tree's descent): no count per iteration.
                return None
            count += bool(op) and op.group(1) not in free
    return count


def breakdown(quick: bool = False) -> list[dict]:
    """Per problem, the cost of one iteration of the solve's loop (all paths, one
    `jax.vmap`ped solve, fastest interleaved round divided by the iterations of the slowest
    path) for the variants of `BREAKDOWN`, each adding one ingredient of an adaptive step to
    ours at fixed steps, and the kernels in the loop (`_loop_kernels`). The ratio of the
    last variant to the first is what an adaptive iteration costs against a fixed one; by
    time, fixed / adaptive at equal error is then the ratio by mean steps divided by that
    and by the lockstep factor (steps of the slowest path over the mean).

    Each problem on its own Brownian path (`path`: "tree", the `VirtualBrownianTree`, or
    "grid" for general noise), and the problems with a tree also on the grid path, whose
    queries cost little: the solver's own cost, which the tree's hides."""
    n_paths = 32 if quick else 128
    n_ref = 2**12 if quick else 2**14
    rows = []
    for name, problem in PROBLEMS.items():
        general = problem["noise"] == "general"
        for grid in (True,) if general else (False, True):
            keys = jr.split(jr.key(sum(map(ord, name))), n_paths)
            keys = path_inputs(problem, keys, n_ref, grid=grid)
            rows += _breakdown_problem(name, problem, keys, n_ref, grid, quick)
    return rows


def _breakdown_problem(name, problem, keys, n_ref, grid, quick) -> list[dict]:
    n_paths = len(jax.tree.leaves(keys)[0])
    fixed = dict(solver=problem["ours"], ito=True, adaptive=False, grid=grid)
    adaptive = dict(fixed, adaptive=True, controller=CONTROLLER)
    # Tolerances no error reaches, the step capped at the fixed one: the error estimate and
    # the controller's work on every step, and the fixed contender's steps.
    loose = dict(CONTROLLER, rtol=1e6, atol=1e6, dtmax=BREAKDOWN_DT)
    all_accepted = dict(adaptive, controller=loose, dt0=BREAKDOWN_DT)
    controller_only = dict(all_accepted, solver=_WithoutEstimate(problem["ours"]))
    per_path = jnp.full(n_paths, BREAKDOWN_DT)
    fns = {
        "fixed": (_make_solve(problem, fixed, n_ref, n_ref), (keys, BREAKDOWN_DT)),
        "fixed, per-path times": (
            _make_solve(problem, fixed, n_ref, n_ref, param_axis=0),
            (keys, per_path),
        ),
        "adaptive, controller only": (
            _make_solve(problem, controller_only, n_ref, n_ref),
            (keys, 0.0),
        ),
        "adaptive, all accepted": (_make_solve(problem, all_accepted, n_ref, n_ref), (keys, 0.0)),
        "adaptive": (_make_solve(problem, adaptive, n_ref, n_ref), (keys, TARGET_RTOL)),
    }
    outputs, times = time_contenders_output(
        fns, repeats=5 if quick else 9, max_time=10.0 if quick else 30.0
    )
    rows, base = [], None
    for what, _ in BREAKDOWN:
        fn, args = fns[what]
        _, steps, ok = outputs[what]
        iterations = int(jnp.max(steps))
        per_iteration = times[what]["run_min_s"] / iterations
        base = base or per_iteration
        rows.append(
            dict(
                problem=name,
                path="grid" if grid else "tree",
                variant=what,
                steps=float(jnp.mean(steps)),
                max_steps_path=iterations,
                failed_paths=int(n_paths - int(jnp.sum(ok))),
                time_per_iteration_s=per_iteration,
                ratio_to_fixed=per_iteration / base,
                loop_kernels=_loop_kernels(jax.jit(fn).lower(*args).compile().as_text()),
                n_paths=n_paths,
                run_min_s=times[what]["run_min_s"],
                run_s=times[what]["run_s"],
            )
        )
    return rows


def breakdown_table(rows: list[dict]) -> str:
    cells = [
        dict(
            r,
            per=f"{r['time_per_iteration_s'] * 1e6:.3g} us",
            ratio=fmt_ratio(r["ratio_to_fixed"]),
            steps=f"{r['steps']:.0f} / {r['max_steps_path']}",
            loop_kernels=r["loop_kernels"] if r["loop_kernels"] is not None else "n/a",
        )
        for r in rows
    ]
    columns = [
        ("problem", "SDE"),
        ("path", "path"),
        ("variant", "loop"),
        ("steps", "steps: mean / slowest path"),
        ("per", "time per iteration"),
        ("ratio", "over fixed"),
        ("loop_kernels", "kernels per iteration"),
    ]
    return markdown_table(cells, columns)


PLOT_MAX_ERROR = 10.0


def plot(rows, out=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    problems = list(dict.fromkeys(r["problem"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(2, len(problems), figsize=(5 * len(problems), 8), squeeze=False)
    for col, problem in enumerate(problems):
        for k, method in enumerate(methods):
            sel = [
                r
                for r in rows
                if r["problem"] == problem
                and r["method"] == method
                and not r["failed_paths"]
                # A solve that blew up (an explicit step past its stability limit) would
                # stretch the axis over fifty decades: left out, and said so below.
                and r["rms_error"] <= PLOT_MAX_ERROR
            ]
            if not sel:
                continue
            style = dict(
                marker="^" if "shared" in method else "o" if method.startswith("ours") else "s",
                ls="-" if method.startswith("ours") else "--",
                color=plt.cm.tab20(k % 20),
                label=method,
                ms=4,
            )
            errs = [r["rms_error"] for r in sel]
            axes[0, col].loglog([r["time_per_path_s"] for r in sel], errs, **style)
            axes[1, col].loglog([r["steps"] for r in sel], errs, **style)
        axes[0, col].set_title(problem, fontsize=10)
        axes[0, col].set_xlabel("wall time per path (s), fastest round")
        axes[1, col].set_xlabel("steps per path (accepted + rejected)")
        for ax in axes[:, col]:
            ax.set_ylabel("RMS error at t = 1")
            ax.grid(True, which="both", alpha=0.3)
    axes[0, 0].legend(fontsize=7)
    fig.text(
        0.5,
        0.005,
        f"Not drawn: points where a path failed or the RMS error exceeds {PLOT_MAX_ERROR:g} "
        "(the solve blew up); every point is in the JSON.",
        ha="center",
        fontsize=8,
    )
    return save_plot(fig, "adaptive_sde", out, dpi=100, rect=(0, 0.02, 1, 1))


def plot_breakdown(rows, out=None):
    """The breakdown's plot: per SDE and path, the time of a loop iteration of each variant
    over the fixed step's (bars), the fixed step at 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys((r["problem"], r["path"]) for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 0.6 + 0.45 * len(cases) * len(variants) / 2))
    height = 0.8 / len(variants)
    for k, variant in enumerate(variants):
        ratios = {
            (r["problem"], r["path"]): r["ratio_to_fixed"] for r in rows if r["variant"] == variant
        }
        ys = [i + k * height for i, case in enumerate(cases) if case in ratios]
        ax.barh(ys, [ratios[c] for c in cases if c in ratios], height, label=variant, color=f"C{k}")
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(cases))])
    ax.set_yticklabels([f"{p} ({path})" for p, path in cases], fontsize=8)
    ax.invert_yaxis()
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("time of a loop iteration / the fixed step's (fastest round)")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(True, axis="x", alpha=0.3)
    return save_plot(fig, "adaptive_sde_breakdown", out, dpi=100)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer paths and tolerances")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="only the cost of a loop iteration, fixed against adaptive, ingredient by "
        "ingredient (`breakdown`), written to adaptive_sde_breakdown",
    )
    options = parser.parse_args(argv)
    if options.breakdown:
        rows = breakdown(quick=options.quick)
        print(breakdown_table(rows))
        name = "adaptive_sde_breakdown" + ("_quick" if options.quick else "")
        note = "quick mode: fewer paths" if options.quick else "full run"
        print(f"wrote {write_results(name, rows, quick=options.quick, note=note)}")
        print(f"plot: {plot_breakdown(rows, out=plot_path(name))}")
        return
    run(quick=options.quick)


if __name__ == "__main__":
    main()
