"""One step size for a whole batch of paths: the batch solved as one system, each path
stepped by the user's solver under a `jax.vmap`, with one accepted-or-rejected decision
and one next step size for all of them (`solve_ensemble(..., shared_step=True)`)."""

import dataclasses
import functools as ft
from collections.abc import Callable
from typing import Any, ClassVar

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, PyTree

from ._compat import is_sde, is_unsafe_sde, use_stepsize_tol, WrapTerm


_NAME = "`solve_ensemble(..., shared_step=True)`"


class EnsembleTerm(diffrax.AbstractTerm):
    """The terms of every path of a batch, as one term that only the shared-step solver
    reads: path `i` has the terms `terms(keys[i])` and the arguments `args[i]` if
    `batch_args`, else `args`. The state is the paths' states, stacked along a leading
    axis."""

    terms: Callable[[PyTree[Array]], PyTree[diffrax.AbstractTerm]]
    # One key per path, or a pytree of per-path arrays (`solve_ensemble`'s `keys`).
    keys: PyTree[Array]
    batch_args: bool = eqx.field(static=True)

    # Path by path, as the solver reads them (what `diffrax.diffeqsolve` checks).
    def vf(self, t, y, args):
        return _per_path(self, lambda path, args, y: path.vf(t, y, args), args, y)

    def contr(self, t0, t1, **kwargs):
        return _per_path(self, lambda path, _: path.contr(t0, t1, **kwargs), None)

    def prod(self, vf, control):
        return _per_path(
            self, lambda path, _, vf, control: path.prod(vf, control), None, vf, control
        )


def _path_terms(terms, key) -> PyTree[diffrax.AbstractTerm]:
    """One path's terms, wrapped as `diffrax.diffeqsolve` wrapped the batch's (with the
    direction of time)."""
    if isinstance(terms, WrapTerm):
        direction = terms.direction
        inner = terms.term.terms(key)
        return jtu.tree_map(
            lambda term: WrapTerm(term, direction),
            inner,
            is_leaf=lambda x: (
                isinstance(x, diffrax.AbstractTerm) and not isinstance(x, diffrax.MultiTerm)
            ),
        )
    if isinstance(terms, EnsembleTerm):
        return terms.terms(key)
    raise TypeError(
        f"{_NAME}: the shared-step solver got terms of type {type(terms).__name__}, which "
        "it cannot split into paths. It only runs inside `solve_ensemble`; adjoints that "
        "rewrite the terms, as `diffrax.BacksolveAdjoint` does, are not supported with "
        "`shared_step=True` (use the default `diffrax.RecursiveCheckpointAdjoint`)."
    )


def _ensemble(terms) -> EnsembleTerm:
    return terms.term if isinstance(terms, WrapTerm) else terms


def _per_path(terms, fn, args, *batched):
    """`fn(path_terms, path_args, *path_values)` for every path, under one `jax.vmap`
    over the leading axis of `batched` (and of `args`, if the batch's are per path;
    shared `args` are closed over, not passed through the `jax.vmap`, so that every
    path's solver sees them exactly as `diffeqsolve` passed them)."""
    ensemble = _ensemble(terms)
    if ensemble.batch_args:
        one = lambda key, args, *values: fn(_path_terms(terms, key), args, *values)
        return jax.vmap(one)(ensemble.keys, args, *batched)
    one = lambda key, *values: fn(_path_terms(terms, key), args, *values)
    return jax.vmap(one)(ensemble.keys, *batched)


def _first_path_terms(terms):
    return _path_terms(terms, jtu.tree_map(lambda x: x[0], _ensemble(terms).keys))


class _EnsembleInterpolation(diffrax.AbstractLocalInterpolation):
    """The paths' own local interpolations over a shared step, evaluated path by path."""

    t0: Any
    t1: Any
    inner: diffrax.AbstractLocalInterpolation

    def evaluate(self, t0, t1=None, left: bool = True) -> PyTree[Array]:
        return jax.vmap(lambda inner: inner.evaluate(t0, t1, left))(self.inner)


def _build_interpolation(cls, *, t0, t1, **dense_info):
    inner = jax.vmap(lambda info: cls(t0=t0, t1=t1, **info))(dense_info)
    return _EnsembleInterpolation(t0=t0, t1=t1, inner=inner)


def _first_failure(result: diffrax.RESULTS) -> diffrax.RESULTS:
    """The result of the first path that failed, or success if none did."""
    failed = result._value != diffrax.RESULTS.successful._value
    index = jnp.argmax(failed)
    return jtu.tree_map(lambda x: x[index], result)


class SharedStepSolver(diffrax.AbstractAdaptiveSolver):
    """Steps every path of an `EnsembleTerm` with `solver`, under one `jax.vmap`,
    over one shared interval `[t0, t1]`; the error estimate is every path's, stacked, so
    that the step-size controller decides for all of them at once (its norm is made the
    largest of the paths' norms by `solve_ensemble`). The batch fails with the first path
    that fails."""

    solver: diffrax.AbstractSolver
    term_structure: ClassVar = EnsembleTerm

    @property
    def interpolation_cls(self):  # pyright: ignore
        return ft.partial(_build_interpolation, self.solver.interpolation_cls)

    def order(self, terms):
        return self.solver.order(_first_path_terms(terms))

    def strong_order(self, terms):
        return self.solver.strong_order(_first_path_terms(terms))

    def error_order(self, terms):
        return self.solver.error_order(_first_path_terms(terms))

    def init(self, terms, t0, t1, y0, args):
        return _per_path(
            terms, lambda path, args, y0: self.solver.init(path, t0, t1, y0, args), args, y0
        )

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        def one(path, args, y0, solver_state):
            return self.solver.step(path, t0, t1, y0, args, solver_state, made_jump)

        y1, y_error, dense_info, solver_state, result = _per_path(
            terms, one, args, y0, solver_state
        )
        return y1, y_error, dense_info, solver_state, _first_failure(result)

    def func(self, terms, t0, y0, args):
        return _per_path(
            terms, lambda path, args, y0: self.solver.func(path, t0, y0, args), args, y0
        )


class MaxOverPaths(eqx.Module):
    """A step-size controller's norm for a batch solved with one step: `norm` of each
    path's scaled error, and the largest of them, so that every path is held to the
    tolerances as if it were solved alone."""

    norm: Callable[[PyTree], Array]

    def __call__(self, tree: PyTree) -> Array:
        return jnp.max(jax.vmap(self.norm)(tree))


class _PerPath(eqx.Module):
    """A `SubSaveAt`'s `fn`, applied path by path to the batch's state."""

    fn: Callable
    batch_args: bool = eqx.field(static=True)

    def __call__(self, t, y, args):
        in_axes = (0, 0 if self.batch_args else None)
        return jax.vmap(lambda y, args: self.fn(t, y, args), in_axes=in_axes)(y, args)


def per_path_saveat(saveat: diffrax.SaveAt, batch_args: bool) -> diffrax.SaveAt:
    """`saveat` for the batch: each `fn` applied to every path's state."""

    def wrap(sub):
        return eqx.tree_at(lambda s: s.fn, sub, _PerPath(sub.fn, batch_args))

    is_sub = lambda x: isinstance(x, diffrax.SubSaveAt)
    subs = jtu.tree_map(wrap, saveat.subs, is_leaf=is_sub)
    return eqx.tree_at(lambda s: s.subs, saveat, subs)


def paths_of(sol: diffrax.Solution, num: int) -> diffrax.Solution:
    """The batch's solution as the paths' solutions, stacked along a leading axis (as a
    `jax.vmap` of per-path solves returns them): the saved values' path axis moved to
    the front, and what every path shares (times, statistics, result) repeated."""
    repeat = lambda tree: jtu.tree_map(lambda x: jnp.broadcast_to(x, (num,) + jnp.shape(x)), tree)
    return dataclasses.replace(
        sol,
        t0=repeat(sol.t0),
        t1=repeat(sol.t1),
        ts=repeat(sol.ts),
        ys=jtu.tree_map(lambda x: jnp.moveaxis(x, 1, 0), sol.ys),
        stats=repeat(sol.stats),
        result=repeat(sol.result),
        made_jump=repeat(sol.made_jump),
    )


_ADJOINTS = (diffrax.RecursiveCheckpointAdjoint, diffrax.DirectAdjoint, diffrax.ForwardMode)


def _has_norm(c) -> bool:
    return (
        isinstance(c, diffrax.AbstractAdaptiveStepSizeController)
        and dataclasses.is_dataclass(c)
        and "norm" in {f.name for f in dataclasses.fields(c)}
    )


def _per_path_norms(controller):
    """`controller` with the `norm` of every controller in it (a wrapped one too, as in
    `diffrax.ClipStepSizeController`) taken path by path."""

    def wrap(c):
        return eqx.tree_at(lambda c: c.norm, c, MaxOverPaths(c.norm)) if _has_norm(c) else c

    return jtu.tree_map(wrap, controller, is_leaf=_has_norm)


def check_shared_step(terms, keys, solver, saveat, kwargs) -> tuple[SharedStepSolver, dict]:
    """Checks the options of `solve_ensemble(..., shared_step=True)` and returns the
    solver and `diffeqsolve` keyword arguments of the batch: `solver` wrapped, the
    controller's norm taken path by path, and the checks and root-finder tolerances
    that `diffrax.diffeqsolve` would apply to one path (it cannot see the paths' terms
    inside the batch's)."""
    kwargs = dict(kwargs)
    if saveat.dense or saveat.solver_state or saveat.controller_state:
        raise ValueError(
            f"{_NAME}: `SaveAt(dense=True)`, `SaveAt(solver_state=True)` and "
            "`SaveAt(controller_state=True)` are not supported: the batch has one dense "
            "interpolation and one state. Save at `ts` instead, or solve without "
            "`shared_step`."
        )
    if kwargs.get("event") is not None:
        raise ValueError(
            f"{_NAME}: events are not supported: an event on one path would stop every "
            "path of the batch. Solve without `shared_step` (each path then stops at its "
            "own event)."
        )
    adjoint = kwargs.get("adjoint")
    if adjoint is not None and not isinstance(adjoint, _ADJOINTS):
        raise ValueError(
            f"{_NAME}: the adjoint {type(adjoint).__name__} is not supported (it rewrites "
            "the terms, which the batch holds as one term per path). Use "
            "`diffrax.RecursiveCheckpointAdjoint` (the default), `diffrax.DirectAdjoint` "
            "or `diffrax.ForwardMode`, or solve without `shared_step`."
        )
    path_terms = eqx.filter_eval_shape(terms, jtu.tree_map(lambda x: x[0], keys))
    controller = kwargs.get("stepsize_controller", diffrax.ConstantStepSize())
    adaptive = isinstance(controller, diffrax.AbstractAdaptiveStepSizeController)
    # What `diffrax.diffeqsolve` checks of one path's terms.
    if adaptive and is_sde(path_terms):
        if isinstance(solver, diffrax.Euler):
            raise ValueError(
                f"{_NAME}: an SDE should not be solved with adaptive step sizes with "
                "Euler's method, as it may not converge to the correct solution."
            )
        if is_unsafe_sde(path_terms):
            raise ValueError(
                f"{_NAME}: `diffrax.UnsafeBrownianPath` cannot be used with adaptive step "
                "sizes: a rejected step re-queries the Brownian motion. Use a "
                "`diffrax.VirtualBrownianTree`."
            )
    if isinstance(solver, diffrax.AbstractImplicitSolver):
        # As `diffrax.diffeqsolve`: the root finder takes the controller's tolerances
        # where it is left to (and its norm, path by path).
        attrs = [
            attr
            for attr in ("rtol", "atol", "norm")
            if getattr(solver.root_finder, attr) is use_stepsize_tol
        ]
        if attrs and not adaptive:
            raise ValueError(
                f"{_NAME}: a fixed step size controller is being used alongside an "
                "implicit solver whose root finder takes its tolerances from the "
                "step-size controller. Use an adaptive step-size controller "
                "(`stepsize_controller=diffrax.PIDController(rtol=..., atol=...)`), or "
                "give the root finder its own `rtol`, `atol` and `norm`."
            )
        if attrs:
            solver = eqx.tree_at(
                lambda s: tuple(getattr(s.root_finder, a) for a in attrs),
                solver,
                tuple(getattr(controller, a) for a in attrs),
            )
    if adaptive:
        if not any(map(_has_norm, jtu.tree_leaves(controller, is_leaf=_has_norm))):
            raise ValueError(
                f"{_NAME}: the step-size controller {type(controller).__name__} has no "
                "`norm` field, so the batch's error cannot be measured path by path. Use "
                "a controller with a `norm` (as `diffrax.PIDController`), or solve "
                "without `shared_step`."
            )
        kwargs["stepsize_controller"] = _per_path_norms(controller)
    return SharedStepSolver(solver), kwargs
