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

**The implicit solvers' root finders.** `python tests/diffrax_suite.py --implicit verychord`
(or `--implicit newton`) runs a second selection, Diffrax's tests of its implicit solvers
(`IMPLICIT_SELECTION`: the ODE order tests, `test_detest.py`, `test_very_chord.py`, the
implicit tests of `test_solver.py`, `test_event.py`, `test_vmap.py`,
`test_adjoint.py::test_implicit`), with `diffrax_linearize.VeryChord` (or `.Newton`) as the
root finder of every implicit solver the tests build. `make test-diffrax` runs, after the
first selection, this one with Diffrax's own root finders (`--implicit diffrax`), then with
both of ours. Diffrax builds its default root finder once, as the
dataclass field default of each solver class (`root_finder=
with_stepsize_controller_tols(VeryChord)()`, `optimistix.Chord` for `ImplicitEuler`), and
the dataclass `__init__` holds that instance in its `__defaults__`; so before collection
the plugin replaces it there (and in the field and the class attribute) in every class of
`diffrax` that has a `root_finder` field, and replaces `diffrax.VeryChord`, which the tests
also call explicitly (`diffrax.Kvaerno5(root_finder=diffrax.VeryChord(rtol=1e-3,
atol=1e-6))`), by a constructor with its signature that returns ours. `optimistix`'s root
finders named in the tests (the references of `test_sil3`, the event root finders) stay.
The report header of each worker names the root finder `diffrax.Kvaerno5()` and
`diffrax.VeryChord(...)` then hold.

Two more legs run Diffrax's own root finders on the same selection:
`--implicit diffrax` (the baseline, as `DIFFRAX_SUITE_PLAIN=1 ... --implicit verychord`
is), and `--implicit upstream`, Diffrax's own with `diffrax.VeryChord.terminate` as fixed
after Diffrax 0.7.2 (diffrax PR #754, the same one-line change as optimistix PR #230,
which ours follows): a divergence only when the iterates diverge, not whenever two
iterations have not converged. `upstream` is evidence, not a substitute: a test that
fails with ours and passes with `diffrax`, but fails with `upstream` the same way, fails
for the termination fix, not for anything else of ours.

**The stiff solvers.** `python tests/diffrax_suite.py --stiff` runs Diffrax's tests that
take a list of solvers or build its implicit solvers (`STIFF_SELECTION`: `test_ode_order`,
`test_basic`, `test_grad_implicit_solve`, `test_no_jit`, `test_static`,
`test_implicit_tol_error`, `test_detest.py`, `test_rober`, `test_implicit_closure_convert`,
`test_dense_interpolation` and its `vmap` twin, `test_implicit_runge_kutta_direct_adjoint`,
`test_boolean_with_root_find_terminating_on_first_step`) with ours of the same order in
place of Diffrax's implicit solvers: `diffrax.ImplicitEuler` builds
`diffrax_linearize.BDF(max_order=1, ndf=False)` (backward Euler), `Kvaerno3` `ROS34PW2`,
`Kvaerno4` `Rodas4P`, `Kvaerno5` `Rodas5P` (`STIFF_SUBSTITUTES`). Before collection each of
those four names becomes a stand-in class (`_StandIn`): calling it builds ours (a
`root_finder=` argument goes to the BDF, which takes its tolerances from it, and is
dropped for the Rosenbrock methods, which make no nonlinear solve), `isinstance` against
it recognises ours, and its other attributes (`Kvaerno5.tableau`) are Diffrax's. Ours that
stand in for none of Diffrax's are appended to the parameter lists (`STIFF_ADDED`: the
BDF of order 2 in `test_ode_order`, the default and the variable-order BDF in the DETEST
problems), and the parametrised tests keep only the cases of ours. Known differences of
method (and one harness mismatch) are strict xfails with the exception they must raise
(`STIFF_KNOWN_FAILURES`). `DIFFRAX_SUITE_PLAIN=1 ... --stiff` runs the same tests with
Diffrax's own solvers, as a baseline.

**The step-size controller.** `python tests/diffrax_suite.py --controller` runs Diffrax's
tests whose code names `diffrax.PIDController` (`CONTROLLER_SELECTION`: the controller
tests of `test_adaptive_stepsize_controller.py`, `ClipStepSizeController`'s `step_ts`,
`jump_ts` and revisited rejected steps among them, `test_basic`, `test_reverse_time`,
`test_detest.py`, the events, `SaveAt`, `vmap` and adjoint tests) with
`diffrax_linearize.PredictiveController` in its place: `diffrax.PIDController` becomes a
stand-in (`_StandIn`) that builds ours from the arguments the two share, and a
parametrised controller keeps only the cases of ours. Known differences of control law
are strict xfails (`CONTROLLER_KNOWN_FAILURES`); `DIFFRAX_SUITE_PLAIN=1 ... --controller`
runs the same tests with Diffrax's own, as a baseline. `--stiff --controller` makes both
substitutions in the `--stiff` leg's tests that run the controller: ours under ours
(`STIFF_CONTROLLER_KNOWN_FAILURES`).

**The SDE solvers.** `python tests/diffrax_suite.py --sde` runs Diffrax's SDE solver tests
(`SDE_SELECTION`: `test_sde1.py`, `test_sde2.py`, `test_integrate.py`'s
`test_sde_strong_order`), which list Diffrax's solvers, with ours appended to their lists
(`SDE_ADDED`) and only the cases of ours kept: the strong order of each against itself
and against Euler's or Heun's, its limit against theirs, at the noise each is listed for,
and solves with pytree and complex states and weakly diagonal noise. Known differences
are strict xfails (`SDE_KNOWN_FAILURES`); `DIFFRAX_SUITE_PLAIN=1 ... --sde` runs
Diffrax's own cases.
"""

import os
import pathlib
import subprocess
import sys
import tempfile

import pytest


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
    "test_detest.py": "6dbb20e357893ab1c0e644f0273a3b53905853a0",
    "test_very_chord.py": "1742463095d6d9f40b41643919f506c992dae4c9",
    "test_solver.py": "a022f64458116442355c883f45d911cc954c3935",
    "test_event.py": "6a6b97e1c3c3c44a07e3c5a04c1c1929612eae29",
    "test_vmap.py": "b6379df912d6591a1f4787069182e3be40eb03b1",
    "test_global_interpolation.py": "9c1c236c6d58ed02eab31c68627fbf367f87fa31",
    "test_adaptive_stepsize_controller.py": "d785d16e2481716cfb8918204eadd193bf6c1009",
    "test_sde1.py": "ad7318e6a1b9da7f7d2a44f8309dfc0f344e9095",
    "test_sde2.py": "077177b8a7f0054b91991100226439ea433941d9",
}

SELECTION = [
    "test/test_integrate.py::test_sde_strong_order",
    "test/test_adjoint.py",
    "test/test_saveat_solution.py",
]
# Fails with Diffrax's own classes too on jax 0.10.2 (a dtype promotion inside Diffrax's
# implicit solver under the tests' strict promotion), and uses none of ours.
DESELECTED = ["test/test_adjoint.py::test_implicit"]

# Diffrax's tests that build implicit solvers (or call `diffrax.VeryChord`), for
# `--implicit`. `test_ode_order` and `test_detest.py` run every solver of `helpers.py`;
# only the implicit ones are taken: `all_ode_solvers[10:14]` (`ImplicitEuler`,
# `Kvaerno3`, `Kvaerno4`, `Kvaerno5`) and `all_split_solvers` (`Sil3`, `KenCarp3`,
# `KenCarp4`, `KenCarp5`, `solver14` to `solver17` in `test_ode_order`'s ids).
# `test_vmap.py`, `test_adjoint.py::test_implicit` and most of `test_event.py` build no
# implicit solver: they check that the substitution breaks nothing around them.
_IMPLICIT_ODE = range(10, 14)
IMPLICIT_SELECTION = [
    *(
        f"test/test_integrate.py::test_ode_order[{dtype}-solver{i}]"
        for dtype in ("float64", "complex128")
        for i in [*_IMPLICIT_ODE, 14, 15, 16, 17]
    ),
    "test/test_integrate.py::test_grad_implicit_solve",
    "test/test_integrate.py::test_no_jit",
    "test/test_integrate.py::test_static",
    "test/test_integrate.py::test_implicit_tol_error",
    "test/test_integrate.py::test_vmap_backprop_with_event",
    *(f"test/test_detest.py::test_{p}[solver{i}]" for p in "abcde" for i in _IMPLICIT_ODE),
    "test/test_very_chord.py",
    "test/test_solver.py::test_implicit_euler_adaptive",
    "test/test_solver.py::test_everything_pytree",
    "test/test_solver.py::test_sil3",
    "test/test_solver.py::test_rober",
    "test/test_solver.py::test_implicit_closure_convert",
    "test/test_adjoint.py::test_implicit",
    "test/test_vmap.py",
    "test/test_event.py",
]
# Ours, then Diffrax's own (the baseline) and Diffrax's own with the upstream fix.
ROOT_FINDERS = ("verychord", "newton", "diffrax", "upstream")
# The implicit-solver tests that fail, with the legs they fail in and why (evidence in
# `docs/devdocs/diffrax_tests.md`). Each is marked `xfail(strict=True)` in those legs: it
# still runs, and the run fails if it passes (then the record is out of date) or if any
# other test fails.
KNOWN_FAILURES = {
    "test/test_adjoint.py::test_implicit": (
        ROOT_FINDERS,
        "fails with Diffrax's own classes too on jax 0.10.2: a float64 * int64 "
        "TypePromotionError under the tests' strict promotion, inside Diffrax's "
        "ImplicitAdjoint, with nothing of ours in the traceback",
    ),
    "test/test_solver.py::test_implicit_euler_adaptive": (
        ("verychord", "newton", "upstream"),
        "asserts Diffrax 0.7.2's VeryChord report of a slowly converging chord iteration "
        "as a divergence; with the termination as fixed upstream (diffrax PR #754, "
        "optimistix PR #230; ours, and `--implicit upstream`) it is the nonlinear "
        "solver's maximum number of steps, at the same iterate; Newton (ours and "
        "optimistix.Newton alike) also takes more than the 10 iterations allowed",
    ),
}

# `--stiff`: Diffrax's implicit solvers with ours of the same order in their place, in
# the tests that name them. `diffrax.ImplicitEuler` becomes a `diffrax_linearize.BDF` of
# order 1 with the plain BDF coefficients (`ndf=False`): backward Euler, as
# `ImplicitEuler` is, with this project's chord iteration and error estimate.
STIFF_SUBSTITUTES = {
    "ImplicitEuler": "BDF(max_order=1, ndf=False)",
    "Kvaerno3": "ROS34PW2()",
    "Kvaerno4": "Rodas4P()",
    "Kvaerno5": "Rodas5P()",
}
# Ours that stand in for no Diffrax solver, added to the tests' parameter lists (with
# these ids): the BDF of order 2 in `test_ode_order` (constant steps; from order 3 on,
# the steps of order 1 at the start make a constant-step BDF's global error O(h^2), as
# for any self-starting code, so the test's fitted order would not be the method's), and
# the default BDF and the variable-order one in the DETEST problems (adaptive steps).
STIFF_ADDED = {
    "test_ode_order": {"BDF2": "BDF(max_order=2)"},
    **{
        f"test_{p}": {"BDF": "BDF()", "BDFvar": "BDF(variable_order=True, max_order=5)"}
        for p in "abcde"
    },
}
# The tests that build the substituted solvers. The parametrised ones keep only their
# cases of the substituted solvers (and of the added ones), in both the `--stiff` leg and
# its baseline (`DIFFRAX_SUITE_PLAIN=1`, Diffrax's own). Left out, building none of them:
# `test_vmap.py`, `test_saveat_solution.py`, `test_event.py` but the one below,
# `test_adjoint.py::test_implicit`; and `test_solver.py`'s tableau tests
# (`test_everything_pytree`, `test_multiple_tableau*`), which read `Kvaerno*.tableau` to
# build Diffrax Runge-Kutta solvers (the stand-ins hand Diffrax's tableau on).
STIFF_SELECTION = [
    "test/test_integrate.py::test_basic",
    "test/test_integrate.py::test_ode_order",
    "test/test_integrate.py::test_grad_implicit_solve",
    "test/test_integrate.py::test_no_jit",
    "test/test_integrate.py::test_static",
    "test/test_integrate.py::test_implicit_tol_error",
    "test/test_detest.py",
    "test/test_solver.py::test_rober",
    "test/test_solver.py::test_implicit_closure_convert",
    "test/test_global_interpolation.py::test_dense_interpolation",
    "test/test_global_interpolation.py::test_dense_interpolation_vmap",
    "test/test_adjoint.py::test_implicit_runge_kutta_direct_adjoint",
    "test/test_event.py::test_boolean_with_root_find_terminating_on_first_step",
]
# The `--stiff` leg's known differences, each `xfail(strict=True)` in that leg (see
# `KNOWN_FAILURES`; evidence in `docs/devdocs/diffrax_tests.md`), with the exception it
# must fail with (`raises`: any other failure fails the run).
_RODAS5P_LINEAR = (
    "the test's problem is linear, where Rodas5P's stability function is of order 6 "
    "(its local error on y' = lambda y falls as h^7), so the fitted order is 6.1 to 6.6, "
    "not 5 +- 0.9; on a nonlinear problem it is 5 (tests/test_rosenbrock.py::test_order)"
)
STIFF_KNOWN_FAILURES = {
    "test/test_integrate.py::test_ode_order[float64-solver13]": (_RODAS5P_LINEAR, AssertionError),
    "test/test_integrate.py::test_ode_order[complex128-solver13]": (
        _RODAS5P_LINEAR,
        AssertionError,
    ),
    **{
        f"test/test_global_interpolation.py::{t}[solver10]": (
            "a harness mismatch: the test gives `ImplicitEuler` a tolerance of 1e-3 by "
            "`type(solver)`, and every other solver 1e-6; the BDF of order 1 that stands "
            "in for it is not of that type, and its dense output is backward Euler's, "
            "within 1e-3 (it reaches Diffrax's ImplicitEuler's values to 12 digits)",
            AssertionError,
        )
        for t in ("test_dense_interpolation", "test_dense_interpolation_vmap")
    },
    "test/test_detest.py::test_d[BDFvar]": (
        "the variable-order BDF at the test's rtol = atol = 1e-8 ends 2e-5 to 8e-5 from the "
        "solution of the orbit problems D1 to D5 (eccentricities 0.1 to 0.9, to t = 20), "
        "above the test's 4e-5 on D1 and D2; scipy's BDF at the same tolerances ends "
        "2e-5 to 8e-5 from it too, above 4e-5 on D5: a fifth-order multistep method's "
        "error on a non-stiff orbit, where the test's tolerance is for Runge-Kutta methods",
        AssertionError,
    ),
    "test/test_integrate.py::test_implicit_tol_error": (
        "asserts that Kvaerno5 with a constant step size and no tolerances raises; "
        "Rodas5P has no nonlinear solve and needs none",
        pytest.fail.Exception,
    ),
}

# `--controller`: `diffrax_linearize.PredictiveController` in place of
# `diffrax.PIDController`, in every test whose code names `diffrax.PIDController` (for a
# parametrised controller, only the cases of ours), of these files. `diffrax.PIDController`
# becomes a stand-in (`_StandIn`): calling it builds ours with the arguments the two
# share (`rtol`, `atol`, `norm`, `dtmin`, `dtmax`, `force_dtmin`, `factormin`,
# `factormax`, `safety`, `error_order`), dropping the PID coefficients (`pcoeff`,
# `icoeff`, `dcoeff`: ours is another control law), and `step_ts=`/`jump_ts=` wrap it in
# `diffrax.ClipStepSizeController`, as Diffrax's own `PIDController(step_ts=...)` does.
CONTROLLER_SELECTION = [
    "test/test_adaptive_stepsize_controller.py",
    "test/test_integrate.py",
    "test/test_detest.py",
    "test/test_event.py",
    "test/test_saveat_solution.py",
    "test/test_solver.py",
    "test/test_vmap.py",
    "test/test_adjoint.py",
]
CONTROLLER_DESELECTED = {
    # Diffrax's check of its own `PIDController(step_ts=...)` shim: the stand-in's, not
    # ours.
    "test/test_adaptive_stepsize_controller.py::test_pid_meta",
    # The XLA CPU crash of jaxlib 0.10.2 that strikes it with Diffrax's own classes (see
    # `docs/devdocs/diffrax_tests.md`), and the strict-promotion failure inside Diffrax's
    # `ImplicitAdjoint` (`DESELECTED`).
    "test/test_adjoint.py::test_against",
    "test/test_adjoint.py::test_implicit",
}
# The `--controller` leg's known differences, each `xfail(strict=True)` with the
# exception it must raise (evidence in `docs/devdocs/diffrax_tests.md`).
_STATIONARY_ERROR = (
    "max_steps=4096 reached: Gustafsson's controller, as Hairer's codes, settles where "
    "the error is safety^k (0.9^5 = 0.59, k the solver's error order) and shrinks an "
    "accepted step whose error is above it; Diffrax's PID "
    "controller never shrinks after an accepted step and holds one with an error up to 1. "
    "On this problem (a chord iteration to 1e-3 inside rtol = atol = 1e-10), ours takes "
    "4631 steps to t1, Diffrax's 3766, and both meet the test's tolerance"
)
CONTROLLER_KNOWN_FAILURES = {
    "test/test_adaptive_stepsize_controller.py::test_jump_ts[True]": (
        "backwards in time the jump does not reject steps (with neither controller), so "
        "`jump_ts` only adds the step that ends at it: Diffrax's controller takes 159 "
        "steps without it and 158 with it, ours 164 and 167 (152 + 12 and 153 + 14 "
        "accepted + rejected), where the test wants fewer steps with it; forwards, where "
        "the jump rejects steps, ours takes 221 and 178 (Diffrax's 236 and 185)",
        AssertionError,
    ),
    **{
        f"test/test_solver.py::test_everything_pytree[True-{expensive}-True]": (
            _STATIONARY_ERROR,
            "EquinoxRuntimeError",
        )
        for expensive in ("True", "False")
    },
}

# `--stiff --controller`: the `--stiff` leg with `diffrax_linearize.PredictiveController`
# in place of `diffrax.PIDController` too (as `--controller`), so that Diffrax's tests of
# its implicit solvers run ours under our controller, as this project's guides pair them.
# Its known differences beyond the `--stiff` leg's (strict xfails, as there; one of them
# in place of the `--stiff` leg's).
STIFF_CONTROLLER_KNOWN_FAILURES = {
    f"test/test_detest.py::test_{p}[BDFvar]": (
        "by design: the variable-order BDF chooses its own step sizes and orders and reports "
        "them through its error estimate, which `PredictiveController` cannot read, so "
        "ours refuses it with a ValueError that names `diffrax.PIDController` (which "
        "passes these problems in the `--stiff` leg) and the fixed-order BDF",
        ValueError,
    )
    for p in "abcde"
}

# `--sde`: Diffrax's SDE solver tests, which list Diffrax's stochastic Runge-Kutta
# solvers (none of them a Milstein method), with ours appended to their lists (these ids).
# `test_sde1.py` fits each solver's strong order against itself at the noise it is listed
# for ("com": one Brownian motion, "add": additive noise of seven, on MLP and time-dependent
# SDEs) and checks the limit against Euler's (Itô) or Heun's (Stratonovich) on 100 paths
# of a `diffrax.VirtualBrownianTree`; `test_sde2.py` solves with pytree states and
# Brownian motions, float64 and complex128, and weakly diagonal noise (the deprecated
# `WeaklyDiagonalControlTerm` and a `lineax.DiagonalLinearOperator`). Not listed: the
# general-noise solvers at "any" noise, which need the Lévy areas of each step that a
# `diffrax.VirtualBrownianTree` does not give (`diffrax_linearize.LevyAreaBrownianPath`).
_SDE_ORDERS = {
    "ItoMilstein": (("com", 1), ("add", 1)),
    "StratonovichMilstein": (("com", 1), ("add", 1)),
    "ImplicitItoMilstein": (("com", 1), ("add", 1)),
    "ImplicitStratonovichMilstein": (("com", 1), ("add", 1)),
    "ImplicitEulerMaruyama": (("any", 0.5), ("com", 0.5), ("add", 1)),
    "ItoTaylor15": (("com", 1.5), ("add", 1.5)),
}
SDE_SELECTION = [
    "test/test_sde1.py",
    "test/test_sde2.py",
    "test/test_integrate.py::test_sde_strong_order",
]
# `test_integrate.py::test_sde_strong_order` fits the order against Euler's (Itô) or Heun's
# (Stratonovich) solution on 20 paths, at "com" and "any" noise (its "add" cases return
# at once); it lists Diffrax's Milstein solvers itself, at "any" noise and, the
# Stratonovich one, at "com" (the first leg runs them with ours substituted).
_INTEGRATE_ORDERS = {
    "ItoMilstein": (("com", 1),),
    "ImplicitItoMilstein": (("com", 1), ("any", 0.5)),
    "ImplicitStratonovichMilstein": (("com", 1), ("any", 0.5)),
    "ImplicitEulerMaruyama": (("com", 0.5), ("any", 0.5)),
    "ItoTaylor15": (("com", 1.5),),
}
SDE_ADDED = {
    "test_sde_strong_order": {
        f"{name}-{noise}-{order}": (name, noise, order)
        for name, orders in _INTEGRATE_ORDERS.items()
        for noise, order in orders
    },
    **{
        test: {
            f"{name}-{noise}-{order}": (name, noise, order)
            for name, orders in _SDE_ORDERS.items()
            for noise, order in orders
        }
        for test in ("test_sde_strong_order_new", "test_sde_strong_limit")
    },
    **{
        test: {name: name for name in _SDE_ORDERS}
        for test in ("test_sde_solver_shape", "test_weakly_diagonal_noise")
    },
}
# The `--sde` leg's known differences, each `xfail(strict=True)` with the exception it
# must raise (evidence in `docs/devdocs/diffrax_tests.md`).
_ROOT_FIND = (
    "a drift-implicit step on the test's additive-noise SDE (a drift through a five-layer "
    "MLP of Laplace-distributed weights, seven noise channels) at its coarsest steps, 5/2 "
    "to 5/8: the root find does not converge in the default 10 iterations (measured with "
    "ImplicitEulerMaruyama: nor in 100 of the chord iteration, nor in 20 of Newton's; in "
    "50 of Newton's it does), and at 5/128 one path of the 100 needs more than 10; with "
    "constant steps a failed root find ends the solve, as for Diffrax's implicit solvers"
)
SDE_KNOWN_FAILURES = {
    **{
        f"test/test_sde1.py::test_sde_strong_order_new[float64-{name}-add-1]": (
            _ROOT_FIND,
            "EquinoxRuntimeError",
        )
        for name in ("ImplicitItoMilstein", "ImplicitStratonovichMilstein", "ImplicitEulerMaruyama")
    },
    "test/test_integrate.py::test_sde_strong_order[float64-ImplicitEulerMaruyama-com-0.5]": (
        "the fitted order is 0.91, not 0.5 +- 0.3: the test's diffusion is small (0.25 "
        "tanh), so an Euler-Maruyama step converges about like order one over its steps "
        "(2^-3 to 2^-8); Diffrax's own `diffrax.Euler` there fits 0.92 (the test lists it "
        "at 'any' noise only)",
        AssertionError,
    ),
    "test/test_integrate.py::test_sde_strong_order[float64-ItoTaylor15-com-1.5]": (
        "the fitted order is 0.91, not 1.5 +- 0.3: the test's reference for an Itô solver "
        "is `diffrax.Euler` at 2^-12, itself about 2e-5 from the solution, where ours is "
        "within 3e-5 from 2^-2 on (errors 3.2e-4, 7.7e-5, 2.8e-5, 2.3e-5, 2.4e-5); against "
        "ours at 2^-12 the same errors fit 1.82 (3.2e-4 down to 2e-6). The test lists no "
        "Itô solver above order one at 'com' noise",
        AssertionError,
    ),
    "test/test_sde1.py::test_sde_strong_limit[float64-ImplicitEulerMaruyama-any-0.5]": (
        "an Euler-Maruyama step at the test's 5/128 is 0.0511 from the reference, above the "
        "test's 0.05, which is for the solvers it lists: Diffrax's own `diffrax.Euler` at "
        "the same steps is 0.0511 from it too",
        AssertionError,
    ),
    "test/test_sde1.py::test_sde_strong_limit[float64-ItoTaylor15-add-1.5]": (
        "a Taylor scheme (truncated in g dW) on a strongly nonlinear drift under large "
        "noise: at 5/256 it is 0.25 from the reference, above 0.05; on 20 of the paths, "
        "against SRA1 at 5/2^13, it is about 8 times SRA1's error at each step (0.089 and "
        "0.011 at 5/256), converging to the same solution; with the drift alone within "
        "1.5 times, with a mildly nonlinear drift within 2 times (docs/milstein.md)",
        AssertionError,
    ),
}

ROOT = pathlib.Path(__file__).resolve().parent.parent


# ---- the pytest plugin


def pytest_configure(config):
    if os.environ.get("DIFFRAX_SUITE_PLAIN"):
        return
    import diffrax
    import diffrax_linearize

    # `--stiff --controller` makes both substitutions.
    if os.environ.get("DIFFRAX_SUITE_STIFF"):
        _substitute_stiff_solvers()
    if os.environ.get("DIFFRAX_SUITE_CONTROLLER"):
        _substitute_controller()
    if any(os.environ.get(f"DIFFRAX_SUITE_{leg}") for leg in ("STIFF", "CONTROLLER", "SDE")):
        return

    root_finder = os.environ.get("DIFFRAX_SUITE_ROOT_FINDER")
    if root_finder == "upstream":
        _upstream_very_chord()
    if root_finder in ("diffrax", "upstream"):
        return
    if root_finder:
        _substitute_root_finders(root_finder)
        return
    for name in SUBSTITUTED:
        setattr(diffrax, name, getattr(diffrax_linearize, name))


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc):
    """In the `--stiff` and `--sde` legs, ours of `STIFF_ADDED`/`SDE_ADDED` appended to
    the test's solver parameters, before pytest's own hook reads them (`tryfirst`)."""
    name = metafunc.function.__name__
    if os.environ.get("DIFFRAX_SUITE_PLAIN"):
        return
    if os.environ.get("DIFFRAX_SUITE_STIFF") and name in STIFF_ADDED:
        argnames, added = "solver", STIFF_ADDED[name]
        values = [_ours(ctor) for ctor in added.values()]
    elif os.environ.get("DIFFRAX_SUITE_SDE") and name in SDE_ADDED:
        added = SDE_ADDED[name]
        # `test_sde1.py` lists (solver, noise, order), `test_sde2.py` solvers.
        values = [
            (_ours(v[0]), *v[1:]) if isinstance(v, tuple) else _ours(v) for v in added.values()
        ]
        tuples = isinstance(values[0], tuple)
        argnames = "solver_ctr,noise,theoretical_order" if tuples else "solver_ctr"
    else:
        return
    markers = metafunc.definition.own_markers
    for i, mark in enumerate(markers):
        if mark.name == "parametrize" and mark.args[0] == argnames:
            theirs = list(mark.args[1])
            ids = [f"{argnames.split(',')[0]}{j}" for j in range(len(theirs))] + list(added)
            markers[i] = pytest.mark.parametrize(argnames, theirs + values, ids=ids).mark


def pytest_collection_modifyitems(config, items):
    import pytest

    if os.environ.get("DIFFRAX_SUITE_STIFF"):
        _select_stiff(config, items)
        return
    if os.environ.get("DIFFRAX_SUITE_CONTROLLER"):
        _select_controller(config, items)
        return
    if os.environ.get("DIFFRAX_SUITE_SDE"):
        _select_sde(config, items)
        return
    leg = os.environ.get("DIFFRAX_SUITE_ROOT_FINDER")
    if not leg:
        return
    if os.environ.get("DIFFRAX_SUITE_PLAIN"):
        leg = "diffrax"
    for item in items:
        legs, reason = KNOWN_FAILURES.get(item.nodeid, ((), ""))
        if leg in legs:
            item.add_marker(pytest.mark.xfail(strict=True, reason=reason))


def _substitute_root_finders(name: str) -> None:
    """Ours as the default root finder of every class of `diffrax` with a `root_finder`
    field, and as what `diffrax.VeryChord(...)` builds."""
    import dataclasses
    import inspect

    import diffrax
    import diffrax_linearize as dl
    import optimistix as optx

    cls = {"verychord": dl.VeryChord, "newton": dl.Newton}[name]
    for attr in dir(diffrax):
        solver = getattr(diffrax, attr)
        if not (inspect.isclass(solver) and issubclass(solver, diffrax.AbstractImplicitSolver)):
            continue
        fields = {f.name: f for f in dataclasses.fields(solver)}
        if "root_finder" not in fields:
            continue
        field = fields["root_finder"]
        old = field.default
        if not isinstance(old, optx.AbstractRootFinder):
            continue
        # `optimistix.Chord` (`ImplicitEuler`'s default) stops on the Cauchy test, as
        # `cauchy_termination=True` does.
        cauchy = {} if cls is dl.Newton else {"cauchy_termination": isinstance(old, optx.Chord)}
        new = diffrax.with_stepsize_controller_tols(cls)(**cauchy)
        init = solver.__init__
        init.__defaults__ = tuple(new if d is old else d for d in init.__defaults__ or ())
        field.default = new
        type.__setattr__(solver, "root_finder", new)
        # Checked here, in every process that runs tests (each pytest-xdist worker).
        if type(solver().root_finder) is not cls:
            raise RuntimeError(f"diffrax.{attr}() does not take the substituted root finder.")

    def very_chord(rtol, atol, norm=optx.max_norm, kappa=1e-2, linear_solver=None):
        kwargs = {} if linear_solver is None else {"linear_solver": linear_solver}
        return cls(rtol, atol, norm, kappa, **kwargs)

    diffrax.VeryChord = very_chord


class _StandIn(type):
    """The metaclass of the stand-ins for Diffrax's classes (`diffrax.Kvaerno5` & co. in
    the `--stiff` leg, `diffrax.PIDController` in the `--controller` leg): calling one
    builds ours (`cls.build`); `isinstance` recognises Diffrax's and ours (`cls.is_ours`:
    `test_detest.py` treats `ImplicitEuler` apart); any other attribute (`Kvaerno5.tableau`)
    is Diffrax's class's."""

    def __call__(cls, *args, **kwargs):
        return cls.build(*args, **kwargs)

    def __instancecheck__(cls, obj):
        return isinstance(obj, cls.original) or cls.is_ours(obj)

    def __getattr__(cls, name):
        return getattr(cls.original, name)


def _ours(ctor: str):
    """`diffrax_linearize.<ctor>`: the solver that a constructor of `STIFF_SUBSTITUTES` or
    `STIFF_ADDED` writes out (as text, so that the tables read as the leg's record)."""
    import diffrax_linearize as dl

    return eval(f"dl.{ctor}", {"dl": dl})


def _substitute_stiff_solvers() -> None:
    import diffrax

    for name, ctor in STIFF_SUBSTITUTES.items():
        example = _ours(ctor)

        def build(root_finder=None, *, ctor=ctor):
            # `Kvaerno5(root_finder=...)`: a Rosenbrock method has no nonlinear solve, so
            # the root finder is dropped; the BDF takes its tolerances from it.
            import equinox as eqx

            solver = _ours(ctor)
            if root_finder is not None and hasattr(solver, "root_finder"):
                solver = eqx.tree_at(lambda s: s.root_finder, solver, root_finder)
            return solver

        def is_ours(obj, example=example):
            # The BDF stands in for `ImplicitEuler` at order 1 only: the added BDFs of
            # `STIFF_ADDED` are not `ImplicitEuler`s.
            static = ("max_order", "ndf", "variable_order")
            return type(obj) is type(example) and all(
                getattr(obj, k) == getattr(example, k) for k in static if hasattr(example, k)
            )

        original = getattr(diffrax, name)
        stand_in = _StandIn(
            name,
            (),
            dict(build=staticmethod(build), is_ours=staticmethod(is_ours), original=original),
        )
        setattr(diffrax, name, stand_in)
        # Checked here, in every process that runs tests.
        if type(getattr(diffrax, name)()) is not type(example):
            raise RuntimeError(f"diffrax.{name}() does not build ours.")


def _select_stiff(config, items) -> None:
    """Only the cases of the substituted (and added) solvers of the parametrised tests;
    the known differences marked `xfail(strict=True)`."""
    import diffrax
    from outside_suite import select

    names = list(STIFF_SUBSTITUTES)
    substituted = tuple(getattr(diffrax, n) for n in names)
    added = {i for ids in STIFF_ADDED.values() for i in ids}

    plain = bool(os.environ.get("DIFFRAX_SUITE_PLAIN"))
    controller = bool(os.environ.get("DIFFRAX_SUITE_CONTROLLER"))

    def keep(item):
        params = getattr(getattr(item, "callspec", None), "params", {})
        # `--stiff --controller`: the tests that run the controller (the others are the
        # `--stiff` leg's alone).
        if controller and not _names_controller(item, plain):
            return False
        return "solver" not in params or (
            isinstance(params["solver"], substituted) or item.callspec.id.split("-")[-1] in added
        )

    known = {} if plain else STIFF_KNOWN_FAILURES
    if controller and not plain:
        known = {**known, **_known(STIFF_CONTROLLER_KNOWN_FAILURES)}
    select(config, items, keep, known)


def _predictive_controller(
    rtol=None, atol=None, norm=None, pcoeff=0, icoeff=1, dcoeff=0, dtmin=None, dtmax=None,
    force_dtmin=True, factormin=0.2, factormax=10.0, safety=0.9, error_order=None,
    step_ts=None, jump_ts=None,
):  # fmt: skip
    """What the stand-in for `diffrax.PIDController` builds, from its arguments:
    `diffrax_linearize.PredictiveController`, wrapped in `diffrax.ClipStepSizeController`
    for `step_ts=`/`jump_ts=`."""
    import diffrax
    import diffrax_linearize as dl

    del pcoeff, icoeff, dcoeff
    kwargs = dict(
        dtmin=dtmin, dtmax=dtmax, factormin=factormin, factormax=factormax, safety=safety,
        error_order=error_order,
    )  # fmt: skip
    if norm is not None:
        kwargs["norm"] = norm
    if dtmin is not None:
        kwargs["force_dtmin"] = force_dtmin
    ours = dl.PredictiveController(rtol=rtol, atol=atol, **kwargs)
    if step_ts is None and jump_ts is None:
        return ours
    return diffrax.ClipStepSizeController(ours, step_ts=step_ts, jump_ts=jump_ts)


def _substitute_controller() -> None:
    import diffrax
    import diffrax_linearize as dl

    def is_ours(obj):
        return isinstance(obj, dl.PredictiveController)

    stand_in = _StandIn(
        "PIDController",
        (),
        dict(
            build=staticmethod(_predictive_controller),
            is_ours=staticmethod(is_ours),
            original=diffrax.PIDController,
        ),
    )
    diffrax.PIDController = stand_in
    # Checked here, in every process that runs tests.
    if type(diffrax.PIDController(rtol=1e-3, atol=1e-6)) is not dl.PredictiveController:
        raise RuntimeError("diffrax.PIDController() does not build ours.")


def _is_our_controller(controller) -> bool:
    import diffrax
    import diffrax_linearize as dl

    if isinstance(controller, diffrax.ClipStepSizeController):
        controller = controller.controller
    return isinstance(controller, dl.PredictiveController)


def _select_controller(config, items) -> None:
    """The tests whose code names `diffrax.PIDController`, but for `CONTROLLER_DESELECTED`;
    of a parametrised controller, only the cases of ours (in the baseline,
    `DIFFRAX_SUITE_PLAIN=1`, the same cases with Diffrax's `PIDController`)."""
    from outside_suite import select

    plain = bool(os.environ.get("DIFFRAX_SUITE_PLAIN"))

    def keep(item):
        if item.nodeid.split("[")[0] in CONTROLLER_DESELECTED:
            return False
        return _names_controller(item, plain)

    select(config, items, keep, {} if plain else _known(CONTROLLER_KNOWN_FAILURES))


def _names_controller(item, plain: bool) -> bool:
    """Whether test `item` runs `diffrax.PIDController` (of a parametrised controller, the
    cases of ours; in the baseline, `DIFFRAX_SUITE_PLAIN=1`, of Diffrax's)."""
    import inspect

    import diffrax

    params = getattr(getattr(item, "callspec", None), "params", {})
    if "stepsize_controller" in params:
        controller = params["stepsize_controller"]
        if plain:
            return isinstance(controller, diffrax.PIDController)
        return _is_our_controller(controller)
    if item.nodeid.startswith("test/test_detest.py::"):
        # Its tests solve through a helper, `_test`, that takes `PIDController` for an
        # adaptive solver and constant steps for the others.
        return isinstance(params.get("solver"), diffrax.AbstractAdaptiveSolver)
    return "PIDController" in inspect.getsource(item.function)


def _known(failures: dict) -> dict:
    """`failures` with an exception named as text resolved as equinox's (which is not
    imported before collection)."""
    import equinox

    return {
        nodeid: (reason, getattr(equinox, raises) if isinstance(raises, str) else raises)
        for nodeid, (reason, raises) in failures.items()
    }


def _select_sde(config, items) -> None:
    """The cases of ours (`SDE_ADDED`), their known differences marked
    `xfail(strict=True)`; in the baseline (`DIFFRAX_SUITE_PLAIN=1`), every case."""
    from outside_suite import select

    if os.environ.get("DIFFRAX_SUITE_PLAIN"):
        return

    def keep(item):
        params = getattr(getattr(item, "callspec", None), "params", {})
        return params.get("solver_ctr", object).__module__.startswith("diffrax_linearize")

    select(config, items, keep, _known(SDE_KNOWN_FAILURES))


def upstream_terminate(self, fn, y, args, options, state, tags):
    """`diffrax.VeryChord.terminate` as fixed after Diffrax 0.7.2 (diffrax PR #754,
    optimistix PR #230): 0.7.2's, but for the condition of `nonlinear_divergence`,
    `diverged` where 0.7.2 has `diverged | ~converged`."""
    import jax.numpy as jnp
    import optimistix as optx
    from diffrax._root_finder import _verychord

    del fn, y, args, options, tags
    at_least_two = state.step >= 2
    rate = state.diffsize / state.diffsize_prev
    factor = state.diffsize * rate / (1 - rate)
    small = _verychord._small(state.diffsize)
    diverged = _verychord._diverged(rate)
    converged = _verychord._converged(factor, self.kappa)
    terminate = at_least_two & (small | diverged | converged)
    terminate_result = optx.RESULTS.where(
        at_least_two & jnp.invert(small) & diverged,
        optx.RESULTS.nonlinear_divergence,
        optx.RESULTS.successful,
    )
    linsolve_fail = state.result != optx.RESULTS.successful
    result = optx.RESULTS.where(linsolve_fail, state.result, terminate_result)
    return linsolve_fail | terminate, result


def _upstream_very_chord() -> None:
    from diffrax._root_finder import _verychord

    _verychord.VeryChord.terminate = upstream_terminate


def pytest_report_header(config):
    import diffrax

    if os.environ.get("DIFFRAX_SUITE_STIFF"):
        found = ", ".join(
            f"diffrax.{n}(): {_qualname(getattr(diffrax, n)())}" for n in STIFF_SUBSTITUTES
        )
        whose = "Diffrax's own" if os.environ.get("DIFFRAX_SUITE_PLAIN") else "ours"
        if os.environ.get("DIFFRAX_SUITE_CONTROLLER"):
            found += f", diffrax.PIDController(...): {_qualname(diffrax.PIDController(1e-3, 1e-6))}"
        return f"Diffrax {TAG}'s implicit-solver tests with {whose} stiff solvers ({found})"

    if os.environ.get("DIFFRAX_SUITE_SDE"):
        whose = "Diffrax's own" if os.environ.get("DIFFRAX_SUITE_PLAIN") else "ours added"
        return f"Diffrax {TAG}'s SDE solver tests (test_sde1.py, test_sde2.py), {whose}"

    if os.environ.get("DIFFRAX_SUITE_CONTROLLER"):
        found = _qualname(diffrax.PIDController(rtol=1e-3, atol=1e-6))
        return (
            f"Diffrax {TAG}'s step-size controller tests with diffrax.PIDController(...): {found}"
        )

    root_finder = os.environ.get("DIFFRAX_SUITE_ROOT_FINDER")
    if root_finder:
        found = (
            f"diffrax.Kvaerno5().root_finder: {_qualname(diffrax.Kvaerno5().root_finder)}, "
            f"diffrax.ImplicitEuler().root_finder: "
            f"{_qualname(diffrax.ImplicitEuler().root_finder)}, "
            f"diffrax.VeryChord(1e-3, 1e-6): {_qualname(diffrax.VeryChord(1e-3, 1e-6))}"
        )
        if root_finder == "upstream" and not os.environ.get("DIFFRAX_SUITE_PLAIN"):
            whose = "Diffrax's own (VeryChord's termination as fixed in diffrax PR #754)"
        elif root_finder == "diffrax" or os.environ.get("DIFFRAX_SUITE_PLAIN"):
            whose = "Diffrax's own"
        else:
            whose = "diffrax_linearize's"
        return f"Diffrax {TAG}'s implicit-solver tests with {whose} root finders ({found})"
    if os.environ.get("DIFFRAX_SUITE_PLAIN"):
        return f"Diffrax {TAG}'s tests with Diffrax's own classes (baseline)"
    names = ", ".join(f"diffrax.{n}" for n in SUBSTITUTED)
    return f"Diffrax {TAG}'s tests with diffrax_linearize's classes as {names}"


def _qualname(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


# ---- the driver


def main(argv: list[str]) -> int:
    from outside_suite import fetch

    selection, deselected, env = SELECTION, DESELECTED, dict(os.environ)
    env.pop("DIFFRAX_SUITE_ROOT_FINDER", None)
    env.pop("DIFFRAX_SUITE_STIFF", None)
    env.pop("DIFFRAX_SUITE_CONTROLLER", None)
    env.pop("DIFFRAX_SUITE_SDE", None)
    if argv[:1] == ["--controller"]:
        selection, deselected = CONTROLLER_SELECTION, []
        env["DIFFRAX_SUITE_CONTROLLER"] = "1"
        argv = argv[1:]
    elif argv[:1] == ["--sde"]:
        selection, deselected = SDE_SELECTION, []
        env["DIFFRAX_SUITE_SDE"] = "1"
        argv = argv[1:]
    elif argv[:1] == ["--stiff"]:
        selection, deselected = STIFF_SELECTION, []
        env["DIFFRAX_SUITE_STIFF"] = "1"
        argv = argv[1:]
        if argv[:1] == ["--controller"]:
            env["DIFFRAX_SUITE_CONTROLLER"] = "1"
            argv = argv[1:]
    elif argv[:1] == ["--implicit"]:
        if len(argv) < 2 or argv[1] not in ROOT_FINDERS:
            sys.exit(f"--implicit takes one of {', '.join(ROOT_FINDERS)}.")
        selection, deselected = IMPLICIT_SELECTION, []
        env["DIFFRAX_SUITE_ROOT_FINDER"] = argv[1]
        argv = argv[2:]
    with tempfile.TemporaryDirectory(prefix="diffrax-suite-") as tmp:
        tests = pathlib.Path(tmp) / "test"
        tests.mkdir()
        fetch(tests, "diffrax", REPO, TAG, BLOBS, folder="test")
        # Our own pytest configuration (`-m 'not slow'`, `testpaths`) must not apply.
        (pathlib.Path(tmp) / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow\n")
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), str(ROOT)])
        command = [sys.executable, "-m", "pytest", "-p", "diffrax_suite", "-p", "no:cacheprovider"]
        command += [f"--deselect={d}" for d in deselected] + selection + argv
        print("+", " ".join(command), flush=True)
        return subprocess.run(command, cwd=tmp, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
