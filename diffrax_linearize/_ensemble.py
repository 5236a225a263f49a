"""Monte Carlo ensembles of SDE solves, with the path axis sharded over a device mesh."""

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray, PyTree

from ._refill import check_lanes_options, solve_lanes, start_path
from ._shared_step import check_shared_step, EnsembleTerm, paths_of, per_path_saveat


_REDUCTIONS = ("mean", "var")
# The name of the device axis of the `jax.vmap` that runs one device's paths.
_DEVICES = "devices"
_FAILED_MSG = (
    "`solve_ensemble`: some paths failed to solve (for example by running out of "
    "`max_steps`). Pass `throw=False` and inspect `EnsembleSolution.num_failed` and "
    "`EnsembleSolution.paths.result` to see which."
)


def _default_mesh() -> Mesh:
    """All devices, or the default device alone where one is set (as JAX places a jitted
    function's computation: a platform name means that platform's first local device)."""
    default = jax.config.jax_default_device
    if default is None:
        devices = jax.devices()
    elif isinstance(default, str):
        devices = jax.local_devices(backend=default)[:1]
    else:
        devices = [default]
    return Mesh(np.asarray(devices), ("paths",))


class EnsembleSolution(eqx.Module):
    """The result of [`diffrax_linearize.solve_ensemble`][].

    All reductions are taken over the path axis of the saved values `ys` of the paths
    that solved successfully, leaf by leaf, and are replicated on every device of the
    mesh (so every host of a multi-host run can read them). With `throw=False`, paths
    that fail (`paths.result` not `diffrax.RESULTS.successful`, for example by running
    out of `max_steps`) are left out of them: their saved values after the failure are
    `inf`, as `diffrax.diffeqsolve` leaves them. The reductions are then those of the
    `num_used = num_paths - num_failed` paths that succeeded, which is a conditional
    statistic: if failures are more likely on extreme paths, it is biased. Check
    `num_failed` (or keep `throw=True`) before relying on them.

    **Fields:**

    - `paths`: the per-path `diffrax.Solution`, every array with a leading path axis
        of length `num_paths`, sharded over the mesh; or `None` if `return_paths=False`.
        Failed paths are included here, with their `result`.
    - `ts`: the save times, shared by all paths (those of the first path); `None` if
        nothing was saved.
    - `mean`: the mean over the paths used of `ys`, or `None` if not requested.
    - `var`: the variance over the paths used of `ys` (normalised by `num_used`, as
        `numpy.var` with `ddof=0`; multiply by `num_used / (num_used - 1)` for the
        unbiased estimator), or `None` if not requested.
    - `quantiles`: the quantiles of `ys` over the paths used, each leaf with a leading
        axis of length `len(q)`, computed as `numpy.quantile(..., method="linear")`;
        or `None`.
    - `num_failed`: how many paths did not finish successfully (see
        `diffrax.RESULTS`); the reductions leave those paths out. If every path failed,
        `mean`, `var` and `quantiles` are NaN.
    - `num_paths`: the number of paths, as a Python integer.

    And the property `num_used`, `num_paths - num_failed`: how many paths the
    reductions are over.
    """

    paths: diffrax.Solution | None
    ts: Array | None
    mean: PyTree[Array] | None
    var: PyTree[Array] | None
    quantiles: PyTree[Array] | None
    num_failed: Int[Array, ""]
    num_paths: int = eqx.field(static=True)

    @property
    def num_used(self) -> Int[Array, ""]:
        """How many paths `mean`, `var` and `quantiles` are over: `num_paths -
        num_failed`, the paths that solved successfully."""
        return self.num_paths - self.num_failed


def _is_key_array(x) -> bool:
    if not isinstance(x, jax.Array | np.ndarray):
        return False
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return x.ndim == 1
    # Legacy raw keys, as from `jax.random.PRNGKey(seed)`, stacked: shape (N, 2).
    return x.dtype == jnp.uint32 and x.ndim == 2 and x.shape[1] == 2


def _leading_size(tree: PyTree, what: str) -> int | None:
    sizes = {jnp.shape(x)[0] if jnp.ndim(x) > 0 else None for x in jtu.tree_leaves(tree)}
    if None in sizes:
        fix = (
            "Give every array of `keys` one entry per path."
            if what == "keys"
            else f"Pass `batch_{what}=False` to share `{what}` across all paths."
        )
        raise ValueError(
            f"`solve_ensemble`: `{what}` is batched, so every array in it needs a "
            f"leading path axis, but one of them is a scalar. {fix}"
        )
    if len(sizes) > 1:
        raise ValueError(
            f"`solve_ensemble`: the arrays in the batched `{what}` have different "
            f"leading (path) axis sizes {sorted(sizes)}; they must all have one size."
        )
    return sizes.pop() if sizes else None


def _pad(tree: PyTree, pad: int) -> PyTree:
    """Pads the leading axis by repeating the last entry, so that padded paths are
    ordinary, finite solves (they are masked out of every reduction), and, with
    `shared_step=True`, copies of a path of their own chunk, which change none of its
    steps (padding follows the paths, so a chunk that holds any path holds the one the
    padding copies)."""
    if pad == 0:
        return tree

    def pad_leaf(x):
        x = jnp.asarray(x)
        fill = jnp.broadcast_to(x[-1:], (pad,) + x.shape[1:])
        return jnp.concatenate([x, fill])

    return jtu.tree_map(pad_leaf, tree)


def _psum(x, axis_name):
    # Sums over the devices, if there are several (see `_solve_ensemble`).
    return x if axis_name is None else jax.lax.psum(x, axis_name)


def _chunk_stats(ys, mask):
    """Per-chunk count, means and sums of squared deviations (the statistics that Chan
    et al.'s parallel variance algorithm combines), for every leaf of `ys`."""
    count = jnp.sum(mask)
    expand = lambda y: mask.reshape(mask.shape + (1,) * (y.ndim - 1))

    def mean(y):
        n = jnp.maximum(count, 1).astype(y.dtype)
        return jnp.sum(jnp.where(expand(y), y, 0), axis=0) / n

    means = jtu.tree_map(mean, ys)
    m2s = jtu.tree_map(
        lambda y, m: jnp.sum(jnp.where(expand(y), (y - m) ** 2, 0), axis=0), ys, means
    )
    return count, means, m2s


def _combine_stats(counts, means, m2s, axis_name, total):
    """Combines per-chunk statistics across chunks (axis 0) and devices (`psum`). Only
    arrays of the size of one saved value cross devices. `total` is the number of paths
    counted, over all devices: with none, the mean and variance are NaN."""
    weights = lambda x: counts.reshape(counts.shape + (1,) * (x.ndim - 1)).astype(x.dtype)
    # The count cast explicitly: an integer divisor fails under
    # `jax_numpy_dtype_promotion="strict"`.
    over_total = lambda x: x / jnp.asarray(total).astype(x.dtype)

    def mean(means):
        return over_total(_psum(jnp.sum(weights(means) * means, axis=0), axis_name))

    def var(means, m2s, mean):
        m2 = jnp.sum(m2s + weights(means) * (means - mean) ** 2, axis=0)
        return over_total(_psum(m2, axis_name))

    mean_ = jtu.tree_map(mean, means)
    return mean_, jtu.tree_map(var, means, m2s, mean_)


# Exact distributed order statistics. A float's bit pattern, reinterpreted as a signed
# integer and with the non-sign bits of negative numbers flipped, is monotone in the
# float. A bisection over that integer range finds the k-th smallest value in `nbits`
# steps, each needing only a `psum` of counts, so the values never leave their device.
def _to_ordered_int(x):
    itype = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[x.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(x, itype)
    flip = jnp.array(np.iinfo(itype).max, itype)
    return jnp.where(bits < 0, bits ^ flip, bits)


def _from_ordered_int(i, dtype):
    flip = jnp.array(np.iinfo(i.dtype).max, i.dtype)
    bits = jnp.where(i < 0, i ^ flip, i)
    return jax.lax.bitcast_convert_type(bits, dtype)


def _order_statistic(keys, mask, k, axis_name):
    """The `k`-th smallest (0-based) of the masked `keys` over axis 0 and all devices,
    elementwise over the remaining axes."""
    itype = keys.dtype
    info = np.iinfo(itype)
    m = mask.reshape(mask.shape + (1,) * (keys.ndim - 1))
    lo = jnp.full(keys.shape[1:], info.min, itype)
    hi = jnp.full(keys.shape[1:], info.max, itype)

    def body(_, lo_hi):
        lo, hi = lo_hi
        # Floor of (lo + hi) / 2 without overflow.
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)
        count = jnp.sum(m & (keys <= mid), axis=0, dtype=jnp.int32)
        count = _psum(count, axis_name)
        enough = count >= k + 1
        return jnp.where(enough, lo, mid + 1), jnp.where(enough, mid, hi)

    lo, _ = jax.lax.fori_loop(0, 8 * itype.itemsize, body, (lo, hi))
    return lo


def _quantiles(ys, mask, q, count, axis_name):
    # As `numpy.quantile(..., method="linear")` over the `count` paths of `mask`:
    # interpolate between the order statistics at floor((n - 1) q) and ceil((n - 1) q).
    # `count` is only known on device (failed paths are left out), so this is traced.
    # Integers cast explicitly (as in `_combine_stats`), for strict dtype promotion.
    q = jnp.asarray(q, jnp.result_type(float))
    h = q * (count - 1).astype(q.dtype)
    below = jnp.floor(h).astype(jnp.int32)
    above = jnp.minimum(below + 1, (count - 1).astype(jnp.int32))
    ks = jnp.stack([below, above], axis=1)  # (len(q), 2)
    frac = h - below.astype(h.dtype)

    def leaf(y):
        keys = _to_ordered_int(y)
        stats = jax.lax.map(lambda k: _order_statistic(keys, mask, k, axis_name), ks.ravel())
        stats = _from_ordered_int(stats, y.dtype).reshape((len(q), 2) + y.shape[1:])
        a, b = stats[:, 0], stats[:, 1]
        t = frac.astype(y.dtype).reshape((len(q),) + (1,) * (y.ndim - 1))
        diff = b - a
        # numpy's `_lerp`, which is exact at both ends.
        out = jnp.where(t >= 0.5, b - diff * (1 - t), a + diff * t)
        return jnp.where(count > 0, out, jnp.nan)

    return jtu.tree_map(leaf, ys)


def _check_floating(ys):
    for y in jtu.tree_leaves(ys):
        if not jnp.issubdtype(y.dtype, jnp.floating):
            raise ValueError(
                "`solve_ensemble`: reductions need floating-point saved values, but `ys` "
                f"holds an array of dtype {y.dtype}. Pass `reductions=()` and "
                "`quantiles=None`, or save floating-point values via `saveat`."
            )


def solve_ensemble(
    terms: Callable[[PRNGKeyArray], PyTree[diffrax.AbstractTerm]],
    solver: diffrax.AbstractSolver,
    t0: ArrayLike,
    t1: ArrayLike,
    dt0: ArrayLike | None,
    y0: PyTree[ArrayLike],
    args: PyTree[Any] = None,
    *,
    keys: PRNGKeyArray,
    batch_y0: bool = False,
    batch_args: bool = False,
    saveat: diffrax.SaveAt = diffrax.SaveAt(t1=True),
    reductions: Sequence[str] = ("mean", "var"),
    quantiles: Sequence[float] | Float[ArrayLike, " q"] | None = None,
    return_paths: bool = True,
    chunk_size: int | None = None,
    lanes: int | None = None,
    shared_step: bool = False,
    mesh: Mesh | None = None,
    axis_names: str | Sequence[str] | None = None,
    throw: bool = True,
    **diffeqsolve_kwargs,
) -> EnsembleSolution:
    """Solves one SDE for many Brownian sample paths, with the paths sharded over a
    mesh of devices, and reduces the saved values over paths on device.

    Path $i$ is `diffrax.diffeqsolve(terms(keys[i]), solver, t0, t1, dt0, y0, args,
    saveat=saveat, ...)` (with `y0[i]`, `args[i]` if batched). The path axis is split
    evenly over the devices of `mesh` (a `jax.vmap` over a device axis that XLA
    partitions over the mesh, not a `jax.shard_map`, inside which every implicit solver's
    `lineax.linear_solve` fails: lineax issue #185); each device solves its
    paths `chunk_size` at a time (a `jax.vmap` over a chunk inside a `jax.lax.map` over
    chunks), so memory per device is bounded by the chunk size (plus the saved values,
    if paths or quantiles are requested). A path count that does not divide evenly is
    padded with copies of the last path, which are masked out of every reduction
    exactly and sliced off the returned paths. (The returned `paths` stay sharded when
    the number of devices divides `num_paths`; otherwise XLA cannot shard the path
    axis evenly and gathers `paths` onto every device. Use a divisible path count, or
    `return_paths=False`, to avoid that.)

    What crosses devices: for `"mean"` and `"var"`, one `psum` each of arrays the size
    of one path's saved values (per-device means and sums of squared deviations,
    combined with Chan et al.'s parallel algorithm). For `quantiles`, an exact
    bisection on the bit patterns of the values: $8 \\times$ `itemsize` `psum`s of
    integer counts the size of one path's saved values, per order statistic (two per
    quantile); the values themselves stay on their devices. The per-path solutions,
    if returned, stay sharded. On several devices, each iteration of a `while` loop (a
    step; an implicit solver's root-finder iteration) also takes a scalar all-reduce
    to agree on whether any device still has work.

    Works with every solver, diffrax's or this package's, explicit or implicit, since
    each path is an ordinary `diffrax.diffeqsolve`; with an adaptive step-size
    controller (for example `stepsize_controller=diffrax.PIDController(rtol, atol)` with
    [`diffrax_linearize.ItoMilstein`][]) each path adapts its own steps. Results
    equal `jax.vmap` of `diffeqsolve` over the same keys, path for path, up to
    rounding (XLA may compile one device's batch size differently from the whole batch's).

    **Arguments:**

    - `terms`: a function `key -> terms`, building the terms of the SDE, with their
        Brownian motion, from one key of `keys`. For example
        `lambda key: MultiTerm(ODETerm(f), ControlTerm(g, VirtualBrownianTree(t0, t1,
        tol, shape, key)))`.
    - `solver`, `t0`, `t1`, `dt0`, `y0`, `args`, `saveat`: as for
        `diffrax.diffeqsolve`, shared by every path.
    - `keys`: a one-dimensional array of keys, as from
        `jax.random.split(jax.random.key(seed), num_paths)` (or legacy raw keys of
        shape `(num_paths, 2)`): one path per key. Or, for noise sampled beforehand
        (increments on a grid, say), a container (tuple, dict, `eqx.Module`, ...) of
        arrays with a leading path axis: path $i$ then has the terms `terms(keys[i])`,
        with `[i]` taken of every array.
    - `batch_y0`: if `True`, every array in `y0` has a leading path axis of length
        `num_paths`, and path $i$ starts from `y0[i]`.
    - `batch_args`: likewise for `args`.
    - `reductions`: which of `"mean"` and `"var"` to compute over paths.
    - `quantiles`: probabilities in $[0, 1]$ at which to compute quantiles over paths,
        or `None`.
    - `return_paths`: whether to return the per-path solutions. With `False`, and no
        `quantiles`, each device keeps only the statistics of the chunk it is solving.
    - `chunk_size`: how many paths each device solves at once. Defaults to all of its
        paths.
    - `lanes`: for adaptive step sizes. If given, each device steps `lanes` paths at
        once in one `jax.lax.while_loop`, and a lane whose path has finished takes the
        next path of the device's queue at once, instead of waiting, as a `jax.vmap`
        over a chunk does, for the slowest path of the chunk. The cost is then about
        (sum of steps over paths) / `lanes` loop iterations plus a tail, rather than
        (most steps in a chunk) per chunk: it pays off when step counts vary between
        paths. Each path is the same solve as `diffrax.diffeqsolve` (same steps, same
        `stats`, the same result up to rounding), started by `diffeqsolve` itself, but
        stepped by this function's loop, so: only `saveat=diffrax.SaveAt(t0=..., t1=...,
        fn=...)` (not `ts`, `steps` or `dense`), only `stepsize_controller` and
        `max_steps` among the keyword arguments (no `adjoint`: no reverse-mode
        gradients through it; forward mode works), and not together with `chunk_size`.
        The key must enter `terms(key)` through an array field (as the key of a
        `VirtualBrownianTree`), not a closure. Padding paths are not solved. The
        guide's section "Refilling lanes for adaptive steps" has the details.
    - `shared_step`: for adaptive step sizes. If `True`, the paths that are solved
        together (each chunk of `chunk_size` paths, or all of a device's paths) are
        solved as one system with one step size: every step is taken by `solver` on
        every path at the same times (one `jax.vmap` of its `step`), the step is
        accepted only if it is on every path, and the next step size is the smallest
        any path asks for. The step-size controller's `norm` is applied to each path's
        scaled error and the largest is taken, so each path is held to the tolerances
        as if it were solved alone, only with more (smaller) steps. A loop iteration
        then costs what a fixed step costs (scalar step times, no per-path bookkeeping,
        no waiting for the slowest path), which pays off when the paths' difficulty
        varies at the same times (a burst of noise, a forcing, a switch in the drift);
        when each path's difficulty comes at its own time, per-path steps (the default,
        or `lanes`) take fewer steps. Works with every solver, Diffrax's or this
        package's, explicit or implicit, with any noise. At a fixed step size it gives
        the per-path solutions (up to rounding). Each path sees its own Brownian motion,
        queried at the shared times, so the Brownian motion must be re-queryable (a
        `diffrax.VirtualBrownianTree`). The chunk's `stats` (steps taken) and `result`
        are every one of its paths': a path that fails fails its chunk. Not with `lanes`,
        `SaveAt(dense=True, solver_state=True, controller_state=True)`, events, or an
        adjoint other than `diffrax.RecursiveCheckpointAdjoint`, `diffrax.DirectAdjoint`
        or `diffrax.ForwardMode`.
    - `mesh`: the `jax.sharding.Mesh` to shard paths over. Defaults to a
        one-dimensional mesh of all devices, `jax.devices()` (every host's, after
        `jax.distributed.initialize()`); but where a default device is set
        (`with jax.default_device(device):` or the `jax_default_device` option), a mesh
        of that device alone, where JAX would run a jitted function: `jax.devices()`
        lists the accelerators whatever the default device, so an ensemble asked for on
        the CPU of an accelerator's machine would otherwise run on the accelerator.
    - `axis_names`: the mesh axes to shard paths over (their product). Defaults to all
        axes of `mesh`.
    - `throw`: whether to raise an error if any path fails (for example by running
        out of `max_steps`). With `False`, failed paths are left out of the reductions,
        and `num_failed` says how many (`paths.result` which). On a
        mesh of several devices the check is made on the host once the solve has
        finished (so the call blocks), and `throw=True` is not available inside
        `jax.jit`.
    - `**diffeqsolve_kwargs`: passed on to `diffrax.diffeqsolve`
        (`stepsize_controller`, `max_steps`, `adjoint`, ...).

    **Returns:**

    An [`diffrax_linearize.EnsembleSolution`][].
    """
    if not callable(terms) or isinstance(terms, diffrax.AbstractTerm):
        raise TypeError(
            "`solve_ensemble`: `terms` must be a function `key -> terms` that builds "
            "the SDE's terms, with its Brownian motion, from one key; got "
            f"{type(terms).__name__}. Wrap your terms: "
            "`lambda key: MultiTerm(ODETerm(f), ControlTerm(g, "
            "VirtualBrownianTree(t0, t1, tol, shape, key)))`."
        )
    if _is_key_array(keys):
        num_paths = keys.shape[0]
    else:
        # A bare array that is not an array of keys is a mistake (a container of
        # per-path arrays is not).
        leaves = jtu.tree_leaves(keys)
        bare = isinstance(keys, jax.Array | np.ndarray)
        if bare or not leaves or not all(isinstance(x, jax.Array | np.ndarray) for x in leaves):
            raise TypeError(
                "`solve_ensemble`: `keys` must be a one-dimensional array of keys, as from "
                "`jax.random.split(jax.random.key(seed), num_paths)`, or legacy raw keys "
                "of shape `(num_paths, 2)`, or a pytree of arrays with a leading path axis "
                "(per-path inputs of `terms`, such as noise sampled beforehand); got "
                f"{getattr(keys, 'dtype', type(keys).__name__)} of shape "
                f"{getattr(keys, 'shape', None)}."
            )
        num_paths = _leading_size(keys, "keys")
    if num_paths == 0:
        raise ValueError("`solve_ensemble`: `keys` is empty; pass at least one key.")
    for batched, tree, what in ((batch_y0, y0, "y0"), (batch_args, args, "args")):
        if batched:
            size = _leading_size(tree, what)
            if size is not None and size != num_paths:
                raise ValueError(
                    f"`solve_ensemble`: `{what}` is batched with {size} entries along "
                    f"its leading axis, but there are {num_paths} keys; they must "
                    "match (one per path)."
                )
    reductions = tuple(reductions)
    for r in reductions:
        if r not in _REDUCTIONS:
            raise ValueError(
                f"`solve_ensemble`: unknown reduction {r!r}; `reductions` may hold "
                f"{', '.join(map(repr, _REDUCTIONS))}."
            )
    if quantiles is not None:
        quantiles = tuple(float(x) for x in np.ravel(np.asarray(quantiles)))
        if not all(0.0 <= x <= 1.0 for x in quantiles):
            raise ValueError(f"`solve_ensemble`: `quantiles` must lie in [0, 1]; got {quantiles}.")
    if (reductions or quantiles) and saveat.subs is not None:
        for sub in jtu.tree_leaves(saveat.subs, is_leaf=lambda x: isinstance(x, diffrax.SubSaveAt)):
            if sub.steps:
                raise ValueError(
                    "`solve_ensemble`: with `SaveAt(steps=True)` each path saves at "
                    "its own times, so reductions over paths are meaningless. Pass "
                    "`reductions=()` and `quantiles=None`, or save at fixed `ts`."
                )
    if chunk_size is not None and (
        isinstance(chunk_size, bool)
        or not isinstance(chunk_size, numbers.Integral)
        or chunk_size < 1
    ):
        raise ValueError(
            "`solve_ensemble`: `chunk_size` must be a positive integer (how many paths "
            f"each device solves at once) or `None` for all of them; got {chunk_size!r}."
        )
    if shared_step and lanes is not None:
        raise ValueError(
            "`solve_ensemble`: pass either `shared_step=True` (one step size for the "
            "paths solved together) or `lanes` (each path its own steps, lanes "
            "refilled as paths finish), not both."
        )
    if shared_step:
        solver, diffeqsolve_kwargs = check_shared_step(
            terms, keys, solver, saveat, diffeqsolve_kwargs
        )
    if lanes is not None:
        if isinstance(lanes, bool) or not isinstance(lanes, numbers.Integral) or lanes < 1:
            raise ValueError(
                "`solve_ensemble`: `lanes` must be a positive integer (how many paths "
                f"each device steps at once) or `None`; got {lanes!r}."
            )
        if chunk_size is not None:
            raise ValueError(
                "`solve_ensemble`: pass either `chunk_size` (fixed batches of paths) or "
                "`lanes` (lanes refilled with the next path as theirs finishes), not both."
            )
        check_lanes_options(saveat, diffeqsolve_kwargs)
    if mesh is None:
        mesh = _default_mesh()
    if axis_names is None:
        axis_names = tuple(mesh.axis_names)
    elif isinstance(axis_names, str):
        axis_names = (axis_names,)
    else:
        axis_names = tuple(axis_names)
    for name in axis_names:
        if name not in mesh.axis_names:
            raise ValueError(
                f"`solve_ensemble`: `axis_names` holds {name!r}, which is not an axis "
                f"of `mesh` (its axes are {mesh.axis_names})."
            )
    num_devices = math.prod(mesh.shape[name] for name in axis_names)

    per_device = -(-num_paths // num_devices)
    if lanes is not None:
        chunk = min(int(lanes), per_device)
    else:
        chunk = per_device if chunk_size is None else min(int(chunk_size), per_device)
    num_chunks = -(-per_device // chunk)
    padded = num_devices * per_device
    # `eqx.error_if` raises from a callback; on a mesh of several devices the other
    # devices then wait forever for it in a collective. So there the check is made on
    # the host, after the computation.
    single_device = mesh.size == 1
    out = _solve_ensemble(
        terms,
        solver,
        t0,
        t1,
        dt0,
        y0,
        args,
        keys,
        batch_y0=batch_y0,
        batch_args=batch_args,
        saveat=saveat,
        reductions=reductions,
        quantiles=quantiles,
        return_paths=return_paths,
        chunk=chunk,
        num_chunks=num_chunks,
        per_device=per_device,
        padded=padded,
        num_paths=num_paths,
        refill=lanes is not None,
        shared_step=bool(shared_step),
        mesh=mesh,
        axis_names=axis_names,
        error_if_failed=throw and single_device,
        diffeqsolve_kwargs=diffeqsolve_kwargs,
    )
    if throw and not single_device:
        if isinstance(out.num_failed, jax.core.Tracer):
            raise ValueError(
                "`solve_ensemble`: `throw=True` is not supported inside `jax.jit` "
                "(or other JAX transformations) on a mesh of several devices, as an "
                "error raised on one device would leave the others waiting. Pass "
                "`throw=False` and check `EnsembleSolution.num_failed` instead."
            )
        if out.num_failed > 0:
            raise RuntimeError(_FAILED_MSG)
    return out


@eqx.filter_jit
def _solve_ensemble(
    terms,
    solver,
    t0,
    t1,
    dt0,
    y0,
    args,
    keys,
    *,
    batch_y0,
    batch_args,
    saveat,
    reductions,
    quantiles,
    return_paths,
    chunk,
    num_chunks,
    per_device,
    padded,
    num_paths,
    refill,
    shared_step,
    mesh,
    axis_names,
    error_if_failed,
    diffeqsolve_kwargs,
):
    pad = padded - num_paths
    keys = _pad(keys, pad)
    mask = jnp.arange(padded) < num_paths
    batched = (keys, mask)
    y0_dyn, y0_static = eqx.partition(y0, eqx.is_array)
    args_dyn, args_static = eqx.partition(args, eqx.is_array)
    batched = batched + (_pad(y0_dyn, pad) if batch_y0 else None,)
    batched = batched + (_pad(args_dyn, pad) if batch_args else None,)
    shared = (
        None if batch_y0 else y0_dyn,
        None if batch_args else args_dyn,
        (t0, t1, dt0),
    )
    shared_dyn, shared_static = eqx.partition(
        (shared, terms, solver, saveat, diffeqsolve_kwargs), eqx.is_array
    )
    keep_ys = return_paths or quantiles is not None
    spec = P(axis_names)
    num_devices = padded // per_device
    # The name of the device axis, or `None` on one device (no collectives).
    axis = None if num_devices == 1 else _DEVICES
    static_out = []

    def dynamic_part(sol):
        # The arrays of a solution, which leave the traced program; its static part (the
        # same for every path and chunk) is kept aside once and combined back at the end.
        dynamic, static = eqx.partition(sol, eqx.is_array)
        if not static_out:
            static_out.append(static)
        return dynamic

    def inputs(shared_dyn, y0_i, args_i):
        # The solve's inputs: the shared ones, and `y0` and `args` of a path (or of a
        # chunk, with `shared_step`) where they are batched.
        shared, terms, solver, saveat, kwargs = eqx.combine(shared_dyn, shared_static)
        y0_shared, args_shared, times = shared
        y0 = eqx.combine(y0_shared if y0_i is None else y0_i, y0_static)
        args = eqx.combine(args_shared if args_i is None else args_i, args_static)
        return terms, solver, saveat, kwargs, times, y0, args

    def solve_one(key, y0_i, args_i, shared_dyn):
        terms, solver, saveat, kwargs, (t0, t1, dt0), y0, args = inputs(shared_dyn, y0_i, args_i)
        sol = diffrax.diffeqsolve(
            terms(key),
            solver,
            t0,
            t1,
            dt0,
            y0,
            args,
            saveat=saveat,
            throw=False,
            **kwargs,
        )
        return dynamic_part(sol)

    def solve_together(keys, y0_b, args_b, shared_dyn):
        # `shared_step=True`: the chunk's paths as one system, one step size for all.
        terms, solver, saveat, kwargs, (t0, t1, dt0), y0, args = inputs(shared_dyn, y0_b, args_b)
        num = jtu.tree_leaves(keys)[0].shape[0]
        if y0_b is None:
            y0 = jtu.tree_map(lambda x: jnp.broadcast_to(x, (num,) + jnp.shape(x)), y0)
        sol = diffrax.diffeqsolve(
            EnsembleTerm(terms, keys, batch_args),
            solver,
            t0,
            t1,
            dt0,
            y0,
            args,
            saveat=per_path_saveat(saveat, batch_args),
            throw=False,
            **kwargs,
        )
        return dynamic_part(paths_of(sol, num))

    def start_one(key, y0_i, args_i, shared_dyn):
        terms, solver, saveat, kwargs, (t0, t1, dt0), y0, args = inputs(shared_dyn, y0_i, args_i)
        return start_path(terms, solver, t0, t1, dt0, y0, args, key, saveat, kwargs)

    def reduce(sols, used, failed, stats, ts):
        # The reductions over this device's paths and all devices' (`failed` is already
        # summed over the devices), from the per-chunk `stats`.
        num_used = num_paths - failed
        mean, var = _combine_stats(*stats, axis, num_used) if reductions else (None, None)
        qs = None if quantiles is None else _quantiles(sols.ys, used, quantiles, num_used, axis)
        return (sols if return_paths else None), failed, mean, var, qs, ts

    def on_device_lanes(batched, shared_dyn):
        keys, mask, y0_b, args_b = batched
        # Padding is never solved: the queue holds this device's `sum(mask)` paths.
        sols = solve_lanes(
            lambda key, y0_i, args_i: start_one(key, y0_i, args_i, shared_dyn),
            keys,
            y0_b,
            args_b,
            jnp.sum(mask),
            chunk,
            diffeqsolve_kwargs.get("max_steps", 4096),
            saveat,
            axis_name=axis,
        )
        sols = dynamic_part(sols)
        used = mask & (sols.result._value == 0)
        failed = _psum(jnp.sum(mask & ~used, dtype=jnp.int32), axis)
        if reductions or quantiles is not None:
            _check_floating(sols.ys)
        stats = jtu.tree_map(lambda x: x[None], _chunk_stats(sols.ys, used)) if reductions else None
        ts = None if sols.ts is None else jtu.tree_map(lambda x: x[0], sols.ts)
        return reduce(sols, used, failed, stats, ts)

    def on_device(batched, shared_dyn):
        def per_chunk(batched_chunk):
            keys, mask, y0_b, args_b = batched_chunk
            if shared_step:
                sols = solve_together(keys, y0_b, args_b, shared_dyn)
            else:
                sols = jax.vmap(solve_one, in_axes=(0, 0, 0, None))(keys, y0_b, args_b, shared_dyn)
            # Failed paths (and the padding) are left out of every reduction.
            used = mask & (sols.result._value == 0)
            failed = jnp.sum(mask & ~used, dtype=jnp.int32)
            if reductions or quantiles is not None:
                _check_floating(sols.ys)
            stats = _chunk_stats(sols.ys, used) if reductions else None
            ts = None if sols.ts is None else sols.ts[0]
            return (sols if keep_ys else None), used, failed, stats, ts

        # Padding for the chunks is local to each device, so that slicing it off
        # again moves no data between devices.
        local_pad = num_chunks * chunk - per_device
        keys, mask, y0_b, args_b = batched
        keys, y0_b, args_b = _pad((keys, y0_b, args_b), local_pad)
        mask = jnp.concatenate([mask, jnp.zeros(local_pad, bool)])
        chunked = jtu.tree_map(
            lambda x: x.reshape((num_chunks, chunk) + x.shape[1:]),
            (keys, mask, y0_b, args_b),
        )
        if num_chunks == 1:
            # One chunk: called directly, as `jax.lax.map` would slice (copy) every input
            # of its one iteration, per-path data of any size included.
            one = jtu.tree_map(lambda x: x[0], chunked)
            sols, used, failed, stats, ts = jtu.tree_map(lambda x: x[None], per_chunk(one))
        else:
            sols, used, failed, stats, ts = jax.lax.map(per_chunk, chunked)
        ts = None if ts is None else ts[0]
        unchunk = lambda x: x.reshape((num_chunks * chunk,) + x.shape[2:])[:per_device]
        sols, used = jtu.tree_map(unchunk, (sols, used))
        return reduce(sols, used, _psum(jnp.sum(failed), axis), stats, ts)

    # Not `jax.shard_map`: inside it every value's type carries the manual mesh, which
    # `lineax.linear_solve` drops from the right-hand side but not from the operator's
    # structure, so every implicit solver failed there ("pytree does not match
    # out_structure", lineax issue #185). On one device the function above is simply
    # called on all paths. On several, it is a `jax.vmap` over a leading device axis,
    # sharded over the mesh axes by `spmd_axis_name` and the input sharding: XLA
    # partitions it so that each device solves its own paths, and the `psum`s over the
    # device axis become cross-device reductions. Either way the values inside are
    # ordinary arrays, as in a plain `diffeqsolve`.
    run = on_device_lanes if refill else on_device
    sharded = NamedSharding(mesh, spec)
    if axis is None:
        sols, failed, mean, var, qs, ts = run(batched, shared_dyn)
    else:
        split = lambda x: x.reshape((num_devices, per_device) + x.shape[1:])
        batched = jax.lax.with_sharding_constraint(jtu.tree_map(split, batched), sharded)
        sols, failed, mean, var, qs, ts = jax.vmap(
            run,
            in_axes=(0, None),
            # The reductions are `psum`s over the device axis, so not batched; `ts` is
            # the same on every device (taken from the first).
            out_axes=(0, None, None, None, None, 0),
            axis_name=axis,
            spmd_axis_name=axis_names,
        )(batched, shared_dyn)
        sols = jtu.tree_map(lambda x: x.reshape((padded,) + x.shape[2:]), sols)
        ts = None if ts is None else ts[0]
    sols = jax.lax.with_sharding_constraint(sols, sharded)
    failed, mean, var, qs, ts = jax.lax.with_sharding_constraint(
        (failed, mean, var, qs, ts), NamedSharding(mesh, P())
    )

    if error_if_failed:
        failed = eqx.error_if(failed, failed > 0, _FAILED_MSG)
    if sols is not None:
        if pad:
            # An axis that the devices do not divide evenly cannot stay sharded: XLA
            # gathers it. (Documented in `solve_ensemble`.)
            sols = jtu.tree_map(lambda x: x[:num_paths], sols)
        sols = eqx.combine(sols, static_out[0])
    return EnsembleSolution(
        paths=sols,
        ts=ts,
        mean=mean if "mean" in reductions else None,
        var=var if "var" in reductions else None,
        quantiles=qs,
        num_failed=failed,
        num_paths=num_paths,
    )
