"""Every public solver and transform of the library on the accelerator, in float32 (JAX's
default), against the same program on the same machine's CPU.

Not part of the test suite (CI has no accelerator): run it on a machine that has one,

    python tests/device_check.py [--out results.json]

For each case the same jitted function runs on `jax.devices()[0]` and on
`jax.devices("cpu")[0]`, with the same inputs: the Brownian paths are interpolated from
one array of increments drawn by numpy, so both devices see the same path (a
`diffrax.VirtualBrownianTree` draws its own numbers per backend). A case passes when both
devices return finite results that agree within its tolerance, relative to the largest
entry: rounding for fixed steps and direct computations (`--rtol-fixed`), the
controller's tolerance for adaptive solves, whose accept/reject decisions may go another
way on another device when an error is near the tolerance (`--rtol-adaptive`).

Adaptive solves with general noise are only required to be finite on both: their Lévy
areas are drawn per step from a key made of the step's times, so a step that ends an ulp
away on the other device draws other areas, and the two solutions are those of two
Brownian paths with the same increments and other areas (at fixed steps the times, so
the areas, are the same).

Matrix products run at the device's default precision, as a user's do; on a TPU that
rounds their inputs to bfloat16, so `--rtol-fixed` is then `1e-2` by default.
`--highest` sets `jax_default_matmul_precision="highest"` and `--rtol-fixed` to `1e-4`.
Exit status 1 if any case fails.
"""

import argparse
import json
import platform
import sys
import time
import traceback

import diffrax as dfx
import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np


# The paths: one array of increments on a grid of 2^12 steps over [0, 1], interpolated
# linearly in between (exactly a Brownian path's values at the grid points).
_N = 2**12
_RNG = np.random.default_rng(0)
_W = np.concatenate([np.zeros((1, 2)), np.cumsum(_RNG.normal(size=(_N, 2)) / np.sqrt(_N), 0)])
_H = _RNG.normal(size=(_N, 2)) / np.sqrt(12 * _N)
CONTROLLER_TOL = 1e-3


class _Path(dfx.AbstractBrownianPath):
    """A Brownian path given by its values on a grid, linear in between, with the
    space-time Lévy area of each grid cell held (zero across part of a cell)."""

    W: jax.Array
    H: jax.Array
    levy: type = eqx.field(static=True)

    @property
    def shape(self):
        return jax.ShapeDtypeStruct((2,), self.W.dtype)

    @property
    def t0(self):
        return 0.0

    @property
    def t1(self):
        return 1.0

    @property
    def levy_area(self):
        return self.levy

    def _at(self, t):
        s = jnp.clip(jnp.asarray(t, self.W.dtype) * _N, 0, _N)
        i = jnp.minimum(jnp.floor(s).astype(jnp.int32), _N - 1)
        frac = s - i
        return self.W[i] * (1 - frac) + self.W[i + 1] * frac

    def evaluate(self, t0, t1=None, left=True, use_levy=False):
        del left
        if t1 is None:
            t0, t1 = 0.0, t0
        dw = self._at(t1) - self._at(t0)
        dt = jnp.asarray(t1, dw.dtype) - jnp.asarray(t0, dw.dtype)
        if not use_levy:
            return dw
        if self.levy is dfx.SpaceTimeLevyArea:
            i = jnp.clip(jnp.floor(jnp.asarray(t0, dw.dtype) * _N).astype(jnp.int32), 0, _N - 1)
            return dfx.SpaceTimeLevyArea(dt=dt, W=dw, H=self.H[i] * jnp.sqrt(_N * jnp.abs(dt)))
        return dfx.BrownianIncrement(dt=dt, W=dw)


def _path(levy=dfx.BrownianIncrement):
    return _Path(jnp.asarray(_W, jnp.float32), jnp.asarray(_H, jnp.float32), levy)


def _vol(t):
    return 0.2 + jnp.exp(-200 * (t - 0.5) ** 2)


def _diagonal_terms(path):
    return dfx.MultiTerm(
        dfx.ODETerm(lambda t, y, args: -y),
        dfx.ControlTerm(lambda t, y, args: jnp.diag(_vol(t) * jnp.sin(y + 1)), path),
    )


_A = np.array([[[0.0, 1.0], [-1.0, 0.0]], [[1.0, 0.0], [0.0, -0.5]]], np.float32)


def _general_terms(path):
    def g(t, y, args):
        return _vol(t) * jnp.einsum("jik,k->ij", jnp.asarray(_A), y)

    return dfx.MultiTerm(dfx.ODETerm(lambda t, y, args: -y), dfx.ControlTerm(g, path))


def _robertson(t, y, args):
    k1, k2, k3 = 0.04, 3e7, 1e4
    return jnp.stack(
        [
            -k1 * y[0] + k3 * y[1] * y[2],
            k1 * y[0] - k2 * y[1] ** 2 - k3 * y[1] * y[2],
            k2 * y[1] ** 2,
        ]
    )


def _brusselator(n):
    """The 2D Brusselator with diffusion on a periodic n x n grid (`jnp.roll`)."""
    alpha = 0.02 * (n - 1) ** 2

    def lap(u):
        return (
            jnp.roll(u, 1, 0) + jnp.roll(u, -1, 0) + jnp.roll(u, 1, 1) + jnp.roll(u, -1, 1) - 4 * u
        )

    def f(t, y, args):
        u, v = y[: n * n].reshape(n, n), y[n * n :].reshape(n, n)
        du = 1 + u**2 * v - 4.4 * u + alpha * lap(u)
        dv = 3.4 * u - u**2 * v + alpha * lap(v)
        return jnp.concatenate([du.ravel(), dv.ravel()])

    x = np.linspace(0, 1, n, endpoint=False)
    u0 = 22 * (x[None, :] * (1 - x[None, :])) ** 1.5 * np.ones((n, 1))
    v0 = 27 * (x[:, None] * (1 - x[:, None])) ** 1.5 * np.ones((1, n))
    return f, np.concatenate([u0.ravel(), v0.ravel()]).astype(np.float32)


def cases():
    """name -> (function of no arguments returning a PyTree of arrays, adaptive?, whether
    the two devices' results must agree or only be finite)."""
    import diffrax_linearize as dl

    out = {}
    pid = dfx.PIDController(rtol=CONTROLLER_TOL, atol=CONTROLLER_TOL)
    y0 = jnp.ones(2, jnp.float32)

    sde = {
        "ItoMilstein": (dl.ItoMilstein(), dfx.BrownianIncrement),
        "StratonovichMilstein": (dl.StratonovichMilstein(), dfx.BrownianIncrement),
        "ItoTaylor15": (dl.ItoTaylor15(), dfx.SpaceTimeLevyArea),
        "ImplicitEulerMaruyama": (dl.ImplicitEulerMaruyama(), dfx.BrownianIncrement),
        "ImplicitItoMilstein": (dl.ImplicitItoMilstein(), dfx.BrownianIncrement),
        "ImplicitStratonovichMilstein": (
            dl.ImplicitStratonovichMilstein(),
            dfx.BrownianIncrement,
        ),
    }
    for name, (solver, levy) in sde.items():
        for adaptive in (False, True):

            def fn(solver=solver, levy=levy, adaptive=adaptive):
                kw = dict(stepsize_controller=pid) if adaptive else {}
                dt0 = None if adaptive else 2**-6
                sol = dfx.diffeqsolve(_diagonal_terms(_path(levy)), solver, 0.0, 1.0, dt0, y0, **kw)
                return sol.ys[-1]

            out[f"{name}, {'adaptive' if adaptive else 'fixed steps'}"] = (fn, adaptive, True)

    general = {
        "GeneralItoMilstein": dl.GeneralItoMilstein(),
        "GeneralStratonovichMilstein": dl.GeneralStratonovichMilstein(),
        "ImplicitItoMilstein(general_noise=True)": dl.ImplicitItoMilstein(general_noise=True),
    }
    for name, solver in general.items():
        for adaptive in (False, True):

            def fn(solver=solver, adaptive=adaptive):
                # The Lévy areas are drawn per step from keys that both devices derive
                # alike (threefry is the same program on both).
                path = dl.LevyAreaBrownianPath(_path(), dt=2**-6, key=jax.random.key(5))
                kw = dict(stepsize_controller=pid) if adaptive else {}
                dt0 = None if adaptive else 2**-6
                sol = dfx.diffeqsolve(_general_terms(path), solver, 0.0, 1.0, dt0, y0, **kw)
                return sol.ys[-1]

            key = f"{name}, {'adaptive' if adaptive else 'fixed steps'}"
            out[key] = (fn, adaptive, not adaptive)

    def backsolve_grad():
        def loss(y):
            sol = dfx.diffeqsolve(
                _diagonal_terms(_path()),
                dl.ItoMilstein(),
                0.0,
                1.0,
                2**-6,
                y,
                adjoint=dl.BacksolveAdjoint(),
            )
            return jnp.sum(sol.ys[-1] ** 2)

        return jax.grad(loss)(y0)

    out["jax.grad through BacksolveAdjoint (ItoMilstein, fixed steps)"] = (
        backsolve_grad,
        False,
        True,
    )

    def ensemble_shared():
        # No `mesh`: the default mesh is the default device `_run` sets (the check
        # asserts where the output lives).
        sol = dl.solve_ensemble(
            lambda key: _diagonal_terms(_path()),
            dl.ItoMilstein(),
            0.0,
            1.0,
            None,
            y0,
            keys=jax.random.split(jax.random.key(1), 4),
            shared_step=True,
            stepsize_controller=pid,
        )
        return sol.paths.ys[:, -1]

    out["solve_ensemble(shared_step=True), ItoMilstein adaptive"] = (ensemble_shared, True, True)

    stiff = {
        "Rodas5P": (dl.Rodas5P(), dl.PredictiveController),
        "Rodas4P": (dl.Rodas4P(), dl.PredictiveController),
        "ROS34PW2": (dl.ROS34PW2(), dl.PredictiveController),
        "BDF": (dl.BDF(), dfx.PIDController),
        "BDF(variable_order=True)": (dl.BDF(variable_order=True), dfx.PIDController),
        "Kvaerno5(root_finder=VeryChord())": (
            dfx.Kvaerno5(root_finder=dl.VeryChord()),
            dfx.PIDController,
        ),
        "Kvaerno5(root_finder=Newton())": (
            dfx.Kvaerno5(root_finder=dl.Newton()),
            dfx.PIDController,
        ),
    }
    for name, (solver, controller) in stiff.items():

        def fn(solver=solver, controller=controller):
            sol = dfx.diffeqsolve(
                dfx.ODETerm(_robertson),
                solver,
                0.0,
                1e3,
                None,
                jnp.array([1.0, 0.0, 0.0], jnp.float32),
                stepsize_controller=controller(rtol=1e-4, atol=1e-7),
                max_steps=10_000,
            )
            return sol.ys[-1]

        out[f"{name}, Robertson"] = (fn, True, True)

    f, u0 = _brusselator(16)
    for name, solver in (("BDF", dl.BDF()), ("Rodas5P", dl.Rodas5P())):

        def fn(solver=solver):
            sol = dfx.diffeqsolve(
                dfx.ODETerm(f),
                solver,
                0.0,
                1.0,
                None,
                jnp.asarray(u0),
                stepsize_controller=dfx.PIDController(rtol=1e-4, atol=1e-6),
                max_steps=10_000,
            )
            return sol.ys[-1]

        out[f"{name}, Brusselator 16 x 16 (GMRES path)"] = (fn, True, True)

    m = np.random.default_rng(3).normal(size=(8, 8)).astype(np.float32)

    def dense():
        return dl.materialise(lambda x: jnp.tanh(jnp.asarray(m) @ x), jnp.ones(8, jnp.float32))

    out["materialise, dense"] = (dense, False, True)

    def banded():
        op = dl.materialise_operator(lambda x: x - 0.5 * jnp.roll(x, 1), jnp.ones(64, jnp.float32))
        return lx.linear_solve(op, jnp.arange(64, dtype=jnp.float32)).value

    out["materialise_operator + linear_solve, periodic band"] = (banded, False, True)

    w = np.random.default_rng(3).normal(size=(4, 3)).astype(np.float32)
    x = np.random.default_rng(4).normal(size=(7, 4)).astype(np.float32)

    def squared():
        def loss(w, xi):
            return jnp.sum(jnp.tanh(xi @ w) ** 2)

        return dl.sum_squared_grads(loss, jnp.asarray(w), jnp.asarray(x))

    out["sum_squared_grads, one dense layer"] = (squared, False, True)
    return out


def _run(fn, device):
    with jax.default_device(device):
        out = jax.block_until_ready(jax.jit(fn)())
    assert {d for leaf in jax.tree.leaves(out) for d in leaf.devices()} == {device}
    return jax.tree.map(np.asarray, out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--rtol-fixed", type=float, default=None)
    parser.add_argument("--rtol-adaptive", type=float, default=30 * CONTROLLER_TOL)
    parser.add_argument("--highest", action="store_true", help="full-precision matmuls")
    parser.add_argument(
        "-k", default="", help="only cases whose name contains one of these (comma-separated)"
    )
    args = parser.parse_args(argv)
    if args.highest:
        jax.config.update("jax_default_matmul_precision", "highest")
    if args.rtol_fixed is None:
        args.rtol_fixed = 1e-4 if args.highest else 1e-2
    accelerator, cpu = jax.devices()[0], jax.devices("cpu")[0]
    print(f"jax {jax.__version__}: {accelerator.device_kind} against {cpu.device_kind}")
    rows, failed = [], 0
    for name, (fn, adaptive, comparable) in cases().items():
        if not any(k in name for k in args.k.split(",")):
            continue
        rtol = (args.rtol_adaptive if adaptive else args.rtol_fixed) if comparable else None
        row = dict(case=name, adaptive=adaptive, rtol=rtol, compared=comparable)
        start = time.perf_counter()
        try:
            on_device, on_cpu = _run(fn, accelerator), _run(fn, cpu)
            a = np.concatenate([np.ravel(v) for v in jax.tree.leaves(on_device)])
            b = np.concatenate([np.ravel(v) for v in jax.tree.leaves(on_cpu)])
            scale = float(np.max(np.abs(b)))
            diff = float(np.max(np.abs(a - b))) / scale
            finite = bool(np.all(np.isfinite(a)) and np.all(np.isfinite(b)))
            agree = rtol is None or diff <= rtol
            row.update(relative_difference=diff, finite=finite, ok=finite and agree)
        except Exception as e:  # noqa: BLE001 (reported per case)
            row.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
            traceback.print_exc()
        row["seconds"] = time.perf_counter() - start
        failed += not row["ok"]
        if "error" in row:
            detail = row["error"]
        elif rtol is None:
            detail = f"{row['relative_difference']:.2e}, finite on both (not compared: areas)"
        else:
            detail = f"{row['relative_difference']:.2e} (tolerance {rtol:g})"
        print(f"{'ok  ' if row['ok'] else 'FAIL'} {name}: {detail}", flush=True)
        rows.append(row)
    print(f"{len(rows) - failed} of {len(rows)} pass")
    if args.out:
        from importlib.metadata import version

        record = dict(
            date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            device=accelerator.device_kind,
            platform=accelerator.platform,
            python=platform.python_version(),
            versions={p: version(p) for p in ("jax", "jaxlib", "diffrax", "equinox", "lineax")},
            matmul_precision="highest" if args.highest else "default",
            rows=rows,
        )
        with open(args.out, "w") as file:
            json.dump(record, file, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
