"""Ensembles of adaptive solves on a fixed number of lanes, each of which takes the next
path from a queue as soon as its own path has finished (`solve_ensemble(lanes=...)`).

A `jax.vmap` of `diffrax.diffeqsolve` runs one while loop for the whole batch: it steps
until the slowest path is done, every iteration costing the whole batch. Here one
`jax.lax.while_loop` holds `lanes` independent solver and controller states; when a
lane's path is done, its result is written into the output at the path's index and the
lane restarts on the next path. The batch then costs about (sum of steps over paths) /
`lanes` iterations, plus the tail of the last paths, instead of (max steps) x (paths /
batch size).

Each lane is started by `diffrax.diffeqsolve` itself, run with an adjoint (`_Start`)
whose `loop` returns at once with what `diffeqsolve` prepared, so that dtype promotion,
the direction of time, the implicit solvers' tolerances, the controller's first step
and `solver.init` are all exactly `diffeqsolve`'s. The step is Diffrax 0.7.2's loop
body (`diffrax/_integrate.py: loop`), without events, dense output or intermediate
saves.
"""

from collections.abc import Callable
from typing import Any

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, Bool, Int, PyTree

from ._compat import clip_to_end, is_okay, is_successful, prevbefore, static_select


_ALLOWED_KWARGS = ("stepsize_controller", "max_steps")
_LANES = "`solve_ensemble(..., lanes=...)`"


class _Lane(eqx.Module):
    """One path being solved: what `diffrax.diffeqsolve` prepared for it, and where its
    loop is. Every field is that of `diffeqsolve`'s loop, in its normalised time
    (`t0 < t1`)."""

    terms: PyTree
    solver: diffrax.AbstractSolver
    controller: diffrax.AbstractStepSizeController
    args: PyTree
    t0: Array
    t1: Array
    direction: Array
    saved_t0: PyTree
    y: PyTree
    tprev: Array
    tnext: Array
    solver_state: PyTree
    controller_state: PyTree
    made_jump: Any
    result: diffrax.RESULTS
    num_steps: Array
    num_accepted_steps: Array
    num_rejected_steps: Array


def _is_subsaveat(x) -> bool:
    return isinstance(x, diffrax.SubSaveAt)


class _Start(diffrax.AbstractAdjoint):
    """An "adjoint" whose loop takes no step: it returns `diffeqsolve`'s prepared state
    in the solution's `stats`, to start a lane from."""

    def loop(
        self,
        *,
        args,
        terms,
        solver,
        stepsize_controller,
        event,
        saveat,
        t0,
        t1,
        dt0,
        max_steps,
        throw,
        init_state,
        passed_solver_state,
        passed_controller_state,
        progress_meter,
    ):
        del event, dt0, max_steps, throw, passed_solver_state, passed_controller_state
        del progress_meter

        def save_t0(sub):
            return sub.fn(t0, init_state.y, args) if sub.t0 else None

        lane = _Lane(
            terms=terms,
            solver=solver,
            controller=stepsize_controller,
            args=args,
            t0=t0,
            t1=t1,
            direction=jnp.array(0),  # filled in by `start_path`
            saved_t0=jtu.tree_map(save_t0, saveat.subs, is_leaf=_is_subsaveat),
            y=init_state.y,
            tprev=init_state.tprev,
            tnext=init_state.tnext,
            solver_state=init_state.solver_state,
            controller_state=init_state.controller_state,
            made_jump=init_state.made_jump,
            result=init_state.result,
            num_steps=jnp.asarray(init_state.num_steps),
            num_accepted_steps=jnp.asarray(init_state.num_accepted_steps),
            num_rejected_steps=jnp.asarray(init_state.num_rejected_steps),
        )
        return init_state, {"_refill_lane": lane}


def check_lanes_options(saveat: diffrax.SaveAt, diffeqsolve_kwargs: dict) -> None:
    """Raises a `ValueError` for what the refilling loop cannot do exactly."""
    for name in diffeqsolve_kwargs:
        if name not in _ALLOWED_KWARGS:
            raise ValueError(
                f"{_LANES} passes only `stepsize_controller` and `max_steps` on to the "
                f"solve, not `{name}` (its loop is not `diffrax.diffeqsolve`'s: no "
                "adjoint for reverse-mode gradients, no events, no progress meter). "
                "Pass `lanes=None` (the default) to solve each path with "
                "`diffrax.diffeqsolve`."
            )
    unsupported = []
    if saveat.dense:
        unsupported.append("`dense=True`")
    for what in ("solver_state", "controller_state", "made_jump"):
        if getattr(saveat, what):
            unsupported.append(f"`{what}=True`")
    for sub in jtu.tree_leaves(saveat.subs, is_leaf=_is_subsaveat):
        if sub.ts is not None:
            unsupported.append("`ts=...`")
        if sub.steps:
            unsupported.append("`steps=True`")
    if unsupported:
        raise ValueError(
            f"{_LANES} saves only at `t0` and `t1` (`diffrax.SaveAt(t0=..., t1=..., "
            f"fn=...)`), not {', '.join(sorted(set(unsupported)))}. Save with "
            "`saveat=diffrax.SaveAt(t1=True)`, or pass `lanes=None` (the default) to "
            "solve each path with `diffrax.diffeqsolve`."
        )


def start_path(terms_fn, solver, t0, t1, dt0, y0, args, key, saveat, kwargs) -> _Lane:
    sol = diffrax.diffeqsolve(
        terms_fn(key),
        solver,
        t0,
        t1,
        dt0,
        y0,
        args,
        saveat=saveat,
        adjoint=_Start(),
        throw=False,
        **kwargs,
    )
    lane = sol.stats["_refill_lane"]
    direction = jnp.where(sol.t0 < sol.t1, 1, -1)
    return eqx.tree_at(lambda s: s.direction, lane, direction)


def _done(lane: _Lane, max_steps: int | None) -> Bool[Array, ""]:
    # `diffeqsolve`'s loop condition, and its `max_steps` bound.
    going = (lane.tprev < lane.t1) & is_successful(lane.result)
    if max_steps is not None:
        going = going & (lane.num_steps < max_steps)
    return ~going


def _clip_floor(t1: Array) -> Array:
    # As `diffeqsolve`'s loop: steps ending within 100 ULPs of `t1` end at `t1`.
    for _ in range(100):
        t1 = prevbefore(t1)
    return t1


def _moving(lane: _Lane) -> tuple:
    # The fields of a lane that its steps change.
    return (
        lane.y,
        lane.tprev,
        lane.tnext,
        lane.solver_state,
        lane.controller_state,
        lane.made_jump,
        lane.result,
        lane.num_steps,
        lane.num_accepted_steps,
        lane.num_rejected_steps,
    )


def _step(lane: _Lane, t1_clip_floor: Array) -> _Lane:
    """One step of `diffeqsolve`'s loop (Diffrax 0.7.2, `_integrate.py: loop`), without
    events, dense output and intermediate saves."""
    solver, controller, terms, args = lane.solver, lane.controller, lane.terms, lane.args
    y, y_error, _, solver_state, solver_result = solver.step(
        terms, lane.tprev, lane.tnext, lane.y, args, lane.solver_state, lane.made_jump
    )
    y_error = jtu.tree_map(lambda x: jnp.where(jnp.isnan(x), jnp.inf, x), y_error)
    keep_step, tprev, tnext, made_jump, controller_state, controller_result = (
        controller.adapt_step_size(
            lane.tprev,
            lane.tnext,
            lane.y,
            y,
            args,
            y_error,
            solver.error_order(terms),
            lane.controller_state,
        )
    )
    tprev = jnp.minimum(tprev, lane.t1)
    tnext = clip_to_end(tprev, tnext, lane.t1, t1_clip_floor, keep_step)
    keep = lambda a, b: jnp.where(keep_step, a, b)
    y = jtu.tree_map(keep, y, lane.y)
    solver_state = jtu.tree_map(keep, solver_state, lane.solver_state)
    made_jump = static_select(keep_step, made_jump, lane.made_jump)
    solver_result = diffrax.RESULTS.where(keep_step, solver_result, diffrax.RESULTS.successful)
    result = diffrax.RESULTS.where(is_okay(lane.result), solver_result, lane.result)
    result = diffrax.RESULTS.where(is_okay(result), controller_result, result)
    return eqx.tree_at(
        _moving,
        lane,
        (
            y,
            tprev,
            tnext,
            solver_state,
            controller_state,
            made_jump,
            result,
            lane.num_steps + 1,
            lane.num_accepted_steps + jnp.where(keep_step, 1, 0),
            lane.num_rejected_steps + jnp.where(keep_step, 0, 1),
        ),
        is_leaf=lambda x: x is None,
    )


def _select(pred: Bool[Array, " lanes"], new: PyTree, old: PyTree) -> PyTree:
    """Lane-wise `where` over the arrays of two lane states, kept in `old`'s structure
    (a restarted lane's terms may be new but equal Python objects)."""
    new_leaves, old_leaves = jtu.tree_leaves(new), jtu.tree_leaves(old)
    assert len(new_leaves) == len(old_leaves)

    def where(a, b):
        return jnp.where(pred.reshape(pred.shape + (1,) * (b.ndim - 1)), a, b)

    leaves = [where(a, b) for a, b in zip(new_leaves, old_leaves)]
    return jtu.tree_unflatten(jtu.tree_structure(old), leaves)


def solve_lanes(
    start: Callable[[Any, Any, Any], _Lane],
    keys: Array,
    y0_b: PyTree | None,
    args_b: PyTree | None,
    num: Int[Array, ""],
    lanes: int,
    max_steps: int | None,
    saveat: diffrax.SaveAt,
    axis_name: Any = None,
) -> diffrax.Solution:
    """Solves paths `0, ..., num - 1` of `keys` (and of `y0_b`, `args_b` where batched)
    on `lanes` lanes, refilling each lane from the queue of paths as its path finishes.

    `start(key, y0_i, args_i)` returns the `_Lane` of one path at `t0`. Returns the
    per-path `diffrax.Solution` with a leading axis of `len(keys)`; entries `num` and
    beyond are not solved (their saved values are `inf`).

    `axis_name`: when this runs under `jax.vmap(..., axis_name=axis_name)` (one queue
    per device), the loop's two decisions are taken over that axis with a `psum`, so
    that they stay unbatched: a batched `while_loop` predicate would make every
    iteration select between the old and new carry (the whole output buffer), and a
    batched `cond` would run the restart on every iteration.
    """
    size = jtu.tree_leaves(keys)[0].shape[0]
    take = lambda tree, idx: jtu.tree_map(lambda x: x[idx], tree)

    def start_unfixed(path):
        path = jnp.clip(path, 0, size - 1)
        return start(take(keys, path), take(y0_b, path), take(args_b, path))

    # A Python scalar of the prepared state that a step turns into an array (as `made_jump`
    # when a step can set it, or `diffrax.PIDController(dtmin=...)`'s `at_dtmin` flag) is
    # made that array from the start, as `diffeqsolve`'s `lax.while_loop` does; the others
    # stay Python values (so that, for one, solvers skip the work of a jump at trace time).
    probe = eqx.filter_eval_shape(start_unfixed, 0)
    stepped = _moving(eqx.filter_eval_shape(_step, probe, probe.t1))

    def as_stepped(x, s):
        if eqx.is_array(x) or not isinstance(s, jax.ShapeDtypeStruct):
            return x
        return jnp.asarray(x, dtype=s.dtype)

    def start_path(path):
        lane = start_unfixed(path)
        moving = jtu.tree_map(as_stepped, _moving(lane), stepped, is_leaf=lambda x: x is None)
        return eqx.tree_at(_moving, lane, moving, is_leaf=lambda x: x is None)

    paths = jnp.arange(lanes)
    lane = eqx.filter_vmap(start_path)(paths)
    one_lane = jtu.tree_map(lambda x: x[0] if eqx.is_array(x) else x, lane)
    # `t1` is shared by every path: its clip floor (100 sequential operations, which
    # would dominate the cost of a restart) is computed once.
    t1_clip_floor = _clip_floor(one_lane.t1)
    dynamic, static = eqx.partition(lane, eqx.is_array)

    # The caller's `saveat`: `diffeqsolve`'s copy closes over its own trace (the direction
    # of time), which must not leave `start`.
    subs = saveat.subs

    def allocate(sub):
        count = int(sub.t0) + int(sub.t1)
        struct = eqx.filter_eval_shape(lambda l: sub.fn(l.tprev, l.y, l.args), one_lane)
        ys = jtu.tree_map(lambda s: jnp.full((size, count) + s.shape, jnp.inf, s.dtype), struct)
        return jnp.full((size, count), jnp.inf, one_lane.tprev.dtype), ys

    # Per path: num_steps, num_accepted_steps, num_rejected_steps, result (one array, so
    # one scatter).
    counts = jnp.zeros((size, 4), one_lane.num_steps.dtype)
    outputs = (jtu.tree_map(allocate, subs, is_leaf=_is_subsaveat), counts)
    active = paths < num
    done = eqx.filter_vmap(lambda lane: _done(lane, max_steps))

    def any_(x):
        if axis_name is None:
            return jnp.any(x)
        return jax.lax.psum(jnp.any(x).astype(jnp.int32), axis_name) > 0

    def cond_fun(carry):
        _, _, active, _, _ = carry
        return any_(active)

    def retire_and_restart(retiring, carry):
        """Writes the saves, stats and result of the `retiring` lanes' paths at their
        indices, and restarts those lanes on the next paths of the queue."""
        dynamic, paths, active, next_path, outputs = carry
        lane = eqx.combine(dynamic, static)
        # `mode="drop"` skips the lanes that are not retiring.
        where = jnp.where(retiring, paths, size)

        def write(sub, saved_t0, out):
            ts, ys = out
            parts_t, parts_y = [], []
            if sub.t0:
                parts_t.append(lane.t0)
                parts_y.append(saved_t0)
            if sub.t1:
                parts_t.append(lane.tprev)
                fn = lambda l: sub.fn(l.direction * l.tprev, l.y, l.args)
                parts_y.append(eqx.filter_vmap(fn)(lane))
            if not parts_t:
                return ts, ys
            new_ts = jnp.stack(parts_t, axis=1) * lane.direction[:, None]
            new_ys = jtu.tree_map(lambda *xs: jnp.stack(xs, axis=1), *parts_y)
            ts = ts.at[where].set(new_ts, mode="drop")
            ys = jtu.tree_map(lambda o, n: o.at[where].set(n, mode="drop"), ys, new_ys)
            return ts, ys

        saves, counts = outputs
        saves = jtu.tree_map(write, subs, lane.saved_t0, saves, is_leaf=_is_subsaveat)
        # As `diffeqsolve`: a path stopped by `max_steps` reports it.
        going = (lane.tprev < lane.t1) & is_successful(lane.result)
        result = jnp.where(going, diffrax.RESULTS.max_steps_reached._value, lane.result._value)
        new = (lane.num_steps, lane.num_accepted_steps, lane.num_rejected_steps, result)
        new = jnp.stack([x.astype(counts.dtype) for x in new], axis=1)
        counts = counts.at[where].set(new, mode="drop")
        paths = jnp.where(retiring, next_path + jnp.cumsum(retiring) - 1, paths)
        restarting = retiring & (paths < num)
        # All lanes are started afresh (in one batch, as cheap as one lane on a
        # vector machine) and the restarting ones kept.
        fresh, _ = eqx.partition(eqx.filter_vmap(start_path)(paths), eqx.is_array)
        dynamic = _select(restarting, fresh, dynamic)
        active = jnp.where(retiring, restarting, active)
        next_path = next_path + jnp.sum(retiring)
        return dynamic, paths, active, next_path, (saves, counts)

    def body_fun(carry):
        dynamic, paths, active, next_path, outputs = carry
        lane = eqx.combine(dynamic, static)
        stepping = active & ~done(lane)
        step = lambda lane: _moving(_step(lane, t1_clip_floor))
        stepped, _ = eqx.partition(eqx.filter_vmap(step)(lane), eqx.is_array)
        # Only the state that a step changes is selected (not the terms, solver, ...).
        moving, moving_static = eqx.partition(_moving(lane), eqx.is_array)
        moving = eqx.combine(_select(stepping, stepped, moving), moving_static)
        lane = eqx.tree_at(_moving, lane, moving, is_leaf=lambda x: x is None)
        dynamic, _ = eqx.partition(lane, eqx.is_array)
        retiring = active & done(eqx.combine(dynamic, static))
        carry = dynamic, paths, active, next_path, outputs
        # Only on the iterations where some path has finished: on a CPU the writes and
        # the restart would otherwise dominate the cost of an iteration of a small SDE.
        return jax.lax.cond(any_(retiring), retire_and_restart, lambda _, c: c, retiring, carry)

    carry = (dynamic, paths, active, jnp.asarray(lanes), outputs)
    # Paths done before their first step (`t0 == t1`) are retired by the first iteration.
    _, _, _, _, (saves, counts) = jax.lax.while_loop(cond_fun, body_fun, carry)
    ts = jtu.tree_map(lambda _, s: s[0], subs, saves, is_leaf=_is_subsaveat)
    ys = jtu.tree_map(lambda _, s: s[1], subs, saves, is_leaf=_is_subsaveat)
    result_dtype = jnp.asarray(diffrax.RESULTS.successful._value).dtype
    result = jtu.tree_map(lambda _: counts[:, 3].astype(result_dtype), diffrax.RESULTS.successful)
    # The same for every path, as `diffeqsolve` returns them (in the caller's direction).
    t0 = jnp.full(size, one_lane.t0 * one_lane.direction)
    t1 = jnp.full(size, one_lane.t1 * one_lane.direction)
    return diffrax.Solution(
        t0=t0,
        t1=t1,
        ts=ts,
        ys=ys,
        interpolation=None,
        stats={
            "num_steps": counts[:, 0],
            "num_accepted_steps": counts[:, 1],
            "num_rejected_steps": counts[:, 2],
            "max_steps": max_steps,
        },
        result=result,
        solver_state=None,
        controller_state=None,
        made_jump=None,
        event_mask=None,
    )
