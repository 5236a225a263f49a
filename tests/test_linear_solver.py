"""The GMRES path of `StructuredLinearSolver`: each iterate is GMRES's (the least residual
over the Krylov subspace, against a least-squares reference), a caller's tolerance in
`options` is met with fewer iterations, and an integrator passing its tolerance keeps its
solution (BDF against the same solver with exact LU)."""

import diffrax
import diffrax_linearize as dl
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest
from diffrax_linearize import _linear_solver
from helpers import brusselator_2d


@pytest.fixture
def krylov(monkeypatch):
    """`I - c J` of an 8 x 8 Brusselator (128 unknowns), on the GMRES path (no band)."""
    monkeypatch.setattr(_linear_solver, "_DIRECT_FLOPS", 0)
    field, y0 = brusselator_2d(8)
    op = dl.materialise_operator(lambda y: y - 0.02 * field(y), y0)
    assert isinstance(op, dl.SparseLinearOperator)
    b = jnp.asarray(np.random.RandomState(0).randn(y0.size))
    return op, b, y0


def test_iterates_are_least_residual(krylov):
    # An unreachable tolerance, unit weights and `max_steps=k`, within the first cycle
    # (`_FIRST_CYCLE` iterations; later ones restart): the k-th iterate of
    # right-preconditioned GMRES minimises |b - A P z| over z in span(b, APb, ...,
    # (AP)^{k-1} b), P the inverse of the diagonal; solved here by least squares on an
    # orthonormal basis.
    op, b, _ = krylov
    A = np.asarray(op.as_matrix())
    AP = A / np.diag(A)[None, :]
    bn = np.asarray(b)
    options = {"scale": jnp.ones_like(b), "tolerance": 0.0}
    for k in (2, _linear_solver._FIRST_CYCLE):
        solver = dl.StructuredLinearSolver(max_steps=k, dense_below=0)
        state = solver.init(op, {})
        assert type(state).__name__ == "_Krylov"
        sol = lx.linear_solve(op, b, solver, options=options, throw=False)
        assert sol.result == lx.RESULTS.max_steps_reached
        assert int(sol.stats["num_steps"]) == k
        krylov_basis = np.stack([np.linalg.matrix_power(AP, i) @ bn for i in range(k)], axis=1)
        Q, _ = np.linalg.qr(krylov_basis)
        c, *_ = np.linalg.lstsq(AP @ Q, bn, rcond=None)
        expected = (Q @ c) / np.diag(A)
        np.testing.assert_allclose(
            np.linalg.norm(bn - A @ np.asarray(sol.value)),
            np.linalg.norm(bn - A @ expected),
            rtol=1e-6,  # the reference's power basis is ill-conditioned
        )
        np.testing.assert_allclose(sol.value, expected, rtol=1e-6, atol=1e-9)


def test_restarts_converge(krylov):
    # A Krylov space of 3 restarted until the residual is 1e-10 relative to b.
    op, b, _ = krylov
    solver = dl.StructuredLinearSolver(restart=3, dense_below=0)
    sol = lx.linear_solve(op, b, solver)
    expected = np.linalg.solve(np.asarray(op.as_matrix()), np.asarray(b))
    np.testing.assert_allclose(sol.value, expected, rtol=1e-8, atol=1e-9)
    assert int(sol.stats["num_steps"]) > 3


def test_callers_tolerance(krylov):
    # A chord iteration's scale and tolerance: the weighted residual meets a twentieth of
    # it (`linear_fraction`), in fewer iterations than the default 1e-10, and the solution's
    # error, in the same norm, is within the tolerance.
    op, b, y = krylov
    solver = dl.StructuredLinearSolver(dense_below=0)
    scale = 1e-6 + 1e-4 * jnp.abs(y)
    tolerance = 1e-2
    options = {"scale": scale, "tolerance": tolerance}
    rms = lambda x: float(jnp.sqrt(jnp.mean(x**2)))
    loose = lx.linear_solve(op, b * 1e-4, solver, options=options)
    tight = lx.linear_solve(op, b * 1e-4, solver)
    residual = b * 1e-4 - op.mv(loose.value)
    assert rms(residual / scale) <= solver.linear_fraction * tolerance
    assert 0 < int(loose.stats["num_steps"]) < int(tight.stats["num_steps"])
    exact = np.linalg.solve(np.asarray(op.as_matrix()), np.asarray(b * 1e-4))
    assert rms((loose.value - exact) / scale) <= tolerance
    np.testing.assert_allclose(tight.value, exact, rtol=1e-8, atol=1e-9)  # atol 1e-10


def test_initial_guess(krylov):
    op, b, _ = krylov
    solver = dl.StructuredLinearSolver(dense_below=0)
    exact = jnp.asarray(np.linalg.solve(np.asarray(op.as_matrix()), np.asarray(b)))
    sol = lx.linear_solve(op, b, solver, options={"y0": exact})
    assert int(sol.stats["num_steps"]) == 0
    sol = lx.linear_solve(op, b, solver, options={"y0": exact + 0.1})
    np.testing.assert_allclose(sol.value, exact, rtol=1e-8, atol=1e-9)


def test_vmap(krylov):
    # Right-hand sides that need different numbers of iterations, batched: each solved as
    # alone (a batched loop runs until every member has converged).
    op, b, _ = krylov
    solver = dl.StructuredLinearSolver(dense_below=0)
    exact = jnp.asarray(np.linalg.solve(np.asarray(op.as_matrix()), np.asarray(b)))
    bs = jnp.stack([b, op.mv(exact.at[0].add(1e-3)), 1e-3 * b])
    xs = jax.vmap(lambda b: lx.linear_solve(op, b, solver).value)(bs)
    for x, b in zip(xs, bs):
        expected = np.linalg.solve(np.asarray(op.as_matrix()), np.asarray(b))
        np.testing.assert_allclose(x, expected, rtol=1e-8, atol=1e-9)


def test_complex(monkeypatch):
    monkeypatch.setattr(_linear_solver, "_DIRECT_FLOPS", 0)
    m = 200
    rng = np.random.RandomState(3)
    cols = np.stack([(np.arange(m) + s) % m for s in (0, -1, 1, 7)])
    values = rng.randn(m, 4) + 1j * rng.randn(m, 4)
    values[:, 0] += 5
    op = dl.SparseLinearOperator(
        jnp.asarray(values), cols, jax.ShapeDtypeStruct((m,), jnp.complex128)
    )
    b = jnp.asarray(rng.randn(m) + 1j * rng.randn(m))
    solver = dl.StructuredLinearSolver(dense_below=0)
    assert type(solver.init(op, {})).__name__ == "_Krylov"
    x = lx.linear_solve(op, b, solver).value
    expected = np.linalg.solve(np.asarray(op.as_matrix()), np.asarray(b))
    np.testing.assert_allclose(x, expected, rtol=1e-8, atol=1e-9)


@pytest.mark.slow  # three solves to compile: 40 s on the loaded 2-core machine
def test_bdf_passes_its_tolerance(monkeypatch):
    # A 10 x 10 Brusselator on the GMRES path; BDF passes its chord tolerance, so GMRES
    # stops far above the default 1e-10. The steps, the chord iterations and the accuracy
    # are those of the same solver with exact (LU) solves.
    monkeypatch.setattr(_linear_solver, "_DIRECT_FLOPS", 0)
    field, y0 = brusselator_2d(10)
    op = dl.materialise_operator(field, y0)
    assert type(dl.StructuredLinearSolver().init(op, {})).__name__ == "_Krylov"
    rtol, atol = 1e-6, 1e-8

    def solve(linear_solver):
        return diffrax.diffeqsolve(
            diffrax.ODETerm(lambda t, y, args: field(y)),
            dl.BDF(linear_solver=linear_solver),
            0.0,
            0.5,
            None,
            y0,
            stepsize_controller=diffrax.PIDController(rtol=rtol, atol=atol),
            saveat=diffrax.SaveAt(t1=True, solver_state=True),
        )

    gmres, lu = solve(dl.StructuredLinearSolver()), solve(lx.LU())
    steps = lambda s: int(s.stats["num_steps"])
    assert abs(steps(gmres) - steps(lu)) <= 0.1 * steps(lu)
    newton = lambda s: int(s.solver_state.num_newton_iterations)
    assert newton(gmres) <= 1.2 * newton(lu)
    # Not stiff enough at this size to stop an explicit reference at tight tolerances.
    reference = diffrax.diffeqsolve(
        diffrax.ODETerm(lambda t, y, args: field(y)),
        diffrax.Tsit5(),
        0.0,
        0.5,
        None,
        y0,
        stepsize_controller=diffrax.PIDController(rtol=1e-12, atol=1e-12),
        max_steps=100_000,
    ).ys[-1]
    digits = lambda s: (
        -np.log10(
            float(jnp.max(jnp.abs(s.ys[-1] - reference) / (atol / rtol + jnp.abs(reference))))
        )
    )
    assert digits(gmres) >= digits(lu) - 0.1


def test_matrix_free(krylov):
    # GMRES's state multiplying by a function instead of the materialised operator: the
    # solve is that function's (here of A + I, checked against a dense solve, so that a
    # solve still using A would fail), with the Jacobi preconditioner made from A. A
    # factorisation's state is left as it is.
    op, b, y0 = krylov
    solver = dl.StructuredLinearSolver(dense_below=0)
    state = solver.init(op, {})
    shifted = _linear_solver.matrix_free(state, lambda x: op.mv(x) + x, op)
    x = lx.linear_solve(op, b, solver, state=shifted).value
    A = np.asarray(op.as_matrix())
    expected = np.linalg.solve(A + np.eye(A.shape[0]), np.asarray(b))
    np.testing.assert_allclose(x, expected, rtol=1e-8, atol=1e-9)
    # Its transpose is the materialised operator's (for a solve of the adjoint system).
    transposed = shifted.transpose(solver, {})
    x, _, _ = transposed.solve(b, {})
    np.testing.assert_allclose(x, np.linalg.solve(A.T, np.asarray(b)), rtol=1e-8, atol=1e-9)
    # Detached from its operator (as an integrator carries it), it solves only once given
    # one back.
    detached = _linear_solver.detach(state)
    with pytest.raises(ValueError, match="matrix_free"):
        detached.solve(b, {})
    again = _linear_solver.matrix_free(detached, lambda x: op.mv(x) + x, op)
    x_again = lx.linear_solve(op, b, solver, state=again).value
    np.testing.assert_allclose(x_again, expected, rtol=1e-8, atol=1e-9)
    # Given the function as its operator, its transpose is the function's (by
    # `jax.linear_transpose`), preconditioned alike.
    function = lx.FunctionLinearOperator(lambda x: op.mv(x) + x, op.in_structure())
    by_function = _linear_solver.matrix_free(detached, function.mv, function)
    x, _, _ = by_function.transpose(solver, {}).solve(b, {})
    expected_t = np.linalg.solve(A.T + np.eye(A.shape[0]), np.asarray(b))
    np.testing.assert_allclose(x, expected_t, rtol=1e-8, atol=1e-9)
    # The preconditioner remade from a diagonal is the one made from the operator.
    remade = _linear_solver.with_diagonal(detached, jnp.diag(jnp.asarray(A)))
    np.testing.assert_allclose(remade.inverse_diagonal, detached.inverse_diagonal, rtol=1e-15)
    assert _linear_solver.is_detached(remade) and not _linear_solver.is_detached(state)
    lu_state = lx.LU().init(op, {})
    assert _linear_solver.matrix_free(lu_state, op.mv, op) is lu_state
    assert _linear_solver.detach(lu_state) is lu_state
    direct = dl.StructuredLinearSolver(dense_below=1000).init(op, {})  # dense LU
    assert type(direct).__name__ != "_Krylov"
    assert _linear_solver.matrix_free(direct, op.mv, op) is direct


@pytest.mark.slow  # two solves to compile
def test_bdf_matrix_free(monkeypatch):
    # BDF on the GMRES path multiplies by I - c J through forward-mode derivatives of the
    # vector field and carries only the diagonals of its operators: the same steps, chord
    # iterations (within a few) and end state (to the chord iteration's tolerance) as with
    # exact (LU) solves of the materialised operator.
    monkeypatch.setattr(_linear_solver, "_DIRECT_FLOPS", 0)
    field, y0 = brusselator_2d(10)
    rtol, atol = 1e-6, 1e-8

    def solve(linear_solver):
        return diffrax.diffeqsolve(
            diffrax.ODETerm(lambda t, y, args: field(y)),
            dl.BDF(max_order=5, variable_order=True, linear_solver=linear_solver),
            0.0,
            0.5,
            None,
            y0,
            stepsize_controller=diffrax.PIDController(rtol=rtol, atol=atol),
            saveat=diffrax.SaveAt(t1=True, solver_state=True),
        )

    free, lu = solve(dl.StructuredLinearSolver()), solve(lx.LU())
    assert isinstance(free.solver_state.M_J, lx.DiagonalLinearOperator)
    assert isinstance(lu.solver_state.M_J, dl.SparseLinearOperator)
    for key in ("num_accepted_steps", "num_rejected_steps"):
        assert abs(int(free.stats[key]) - int(lu.stats[key])) <= 1
    iterations = lambda s: int(s.solver_state.num_newton_iterations)
    assert abs(iterations(free) - iterations(lu)) <= 3
    scale = atol + rtol * jnp.abs(lu.ys[-1])
    assert float(jnp.max(jnp.abs(free.ys[-1] - lu.ys[-1]) / scale)) < 1


@pytest.mark.slow
def test_bdf_gmres_refreshes_carry_exact_diagonals(monkeypatch):
    # On the GMRES path a refreshed Jacobian is read as its diagonal only: the carried
    # M_J = I - c_J J and dM = -h_J J at (t_J, y_J) have exactly jax.jacfwd's diagonals,
    # after steps that refreshed it (a Jacobian every step).
    monkeypatch.setattr(_linear_solver, "_DIRECT_FLOPS", 0)
    field, y0 = brusselator_2d(10)
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(lambda t, y, args: field(y)),
        dl.BDF(max_order=5, variable_order=True, jacobian_every=1),
        0.0,
        0.05,
        None,
        y0,
        stepsize_controller=diffrax.PIDController(rtol=1e-6, atol=1e-8),
        saveat=diffrax.SaveAt(t1=True, solver_state=True),
    )
    st = sol.solver_state
    assert isinstance(st.M_J, lx.DiagonalLinearOperator)
    assert int(st.num_jacobians) > 3
    assert float(st.t_J) > 0  # refreshed in a step, not the one of `init`
    J = jnp.diagonal(jax.jacfwd(field)(st.y_J))
    np.testing.assert_allclose(lx.diagonal(st.M_J), 1 - st.c_J * J, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(lx.diagonal(st.dM), -st.h_J * J, rtol=1e-13, atol=1e-15)


def test_jvp_product():
    """`jvp_product(g, t, y)`, the J v of the BDF's and the Rodas solvers' matrix-free
    GMRES products: against `jax.jacfwd`'s Jacobian times `v`, and without derivatives
    in `t` and `y` (as the factorisation it stands in for)."""

    def g(t, y):
        return jnp.sin(t * y) * jnp.roll(y, 1) + y**3

    t, y = 0.7, jnp.linspace(-1.0, 1.0, 6)
    v = jnp.cos(jnp.arange(6.0))
    expected = jax.jacfwd(lambda z: g(t, z))(y) @ v
    np.testing.assert_allclose(_linear_solver.jvp_product(g, t, y)(v), expected, rtol=1e-14)
    grads = jax.grad(lambda t, y: jnp.sum(_linear_solver.jvp_product(g, t, y)(v)), (0, 1))(t, y)
    assert float(grads[0]) == 0 and not np.any(grads[1])


def test_system_with_no_entries():
    # lineax's `Diagonal` solver failed on an empty diagonal ("zero-size array to
    # reduction operation max"), which a state with no entries makes (Diffrax's own
    # `test_basic` solves one).
    y = jnp.zeros(0)
    for op in (
        dl.materialise_operator(lambda y: y - 0.1 * jnp.sin(y), y),
        lx.MatrixLinearOperator(jnp.zeros((0, 0))),
    ):
        out = jax.jit(lambda b: lx.linear_solve(op, b, dl.StructuredLinearSolver()).value)(y)
        assert out.shape == (0,)
