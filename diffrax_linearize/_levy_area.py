r"""Simulation of the iterated stochastic integrals of a multidimensional Brownian motion:
only the Lévy area has to be simulated, conditionally on the increment. The algorithm
(the Fourier series of the Brownian bridge with the tail correction of Mrongowius and
Rößler) and its error are explained in `docs/devdocs/levy_area.md`.
"""

import math
from typing import Literal

import diffrax
import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
from diffrax import AbstractBrownianPath
from jaxtyping import Array, Float, PRNGKeyArray, Real, ScalarLike


LevyAreaMethod = Literal["mrongowius-roessler", "fourier"]
_METHODS = ("mrongowius-roessler", "fourier")

# Folded into the Brownian motion's key, so that the Lévy-area stream is independent of
# the stream that the `VirtualBrownianTree` itself draws from that key.
_LEVY_AREA_SALT = 0x1E7A_A7EA


class IteratedIntegrals(diffrax.AbstractBrownianIncrement):
    r"""A Brownian increment over a step together with its Lévy area: everything a
    strong order one scheme needs about the noise over the step.

    Returned by [`diffrax_linearize.LevyAreaBrownianPath.evaluate`][] and
    [`diffrax_linearize.GridLevyAreaPath.evaluate`][] when called with `use_levy=True`.

    **Fields:**

    - `dt`: the step size $h = t_1 - t_0$.
    - `W`: the increment $\Delta W$, shape `(m,)`.
    - `A`: the Lévy area $A_{j_1 j_2} = \tfrac{1}{2}(I_{j_1 j_2} - I_{j_2 j_1})$,
      antisymmetric, shape `(m, m)`.
    """

    dt: Real[ScalarLike, ""]
    W: Float[Array, " m"]
    A: Float[Array, "m m"]

    def ito(self) -> Float[Array, "m m"]:
        r"""The iterated Itô integrals $I_{j_1 j_2} = \tfrac{1}{2}(\Delta W_{j_1}
        \Delta W_{j_2} - \delta_{j_1 j_2} h) + A_{j_1 j_2}$."""
        eye = jnp.eye(self.W.shape[0], dtype=self.W.dtype)
        with jax.numpy_dtype_promotion("standard"):
            return 0.5 * (jnp.outer(self.W, self.W) - self.dt * eye) + self.A

    def stratonovich(self) -> Float[Array, "m m"]:
        r"""The iterated Stratonovich integrals $J_{j_1 j_2} = \tfrac{1}{2}\Delta W_{j_1}
        \Delta W_{j_2} + A_{j_1 j_2}$."""
        return 0.5 * jnp.outer(self.W, self.W) + self.A


def levy_area_n_terms(m: int, dt: float, precision: float | None = None) -> int:
    r"""The number of Fourier terms for which
    [`diffrax_linearize.sample_levy_area`][] (method `"mrongowius-roessler"`) has
    $\max_{ij} \|A_{ij} - \hat A_{ij}\|_{L^2} \le$ `precision`, from the bound
    $\sqrt{m}\, h / (\sqrt{12}\, \pi\, p)$.

    **Arguments:**

    - `m`: the number of noise channels.
    - `dt`: the (largest) step size $h$.
    - `precision`: the $L^2$ error wanted; defaults to $h^{3/2}$, the local error that
      keeps a Milstein scheme at strong order one.

    **Returns:**

    A Python integer $p \ge 1$; it grows like $\sqrt{m / h}$.
    """
    if dt <= 0:
        raise ValueError(f"`diffrax_linearize.levy_area_n_terms` needs `dt > 0`, got {dt}.")
    if precision is None:
        precision = dt**1.5
    return max(1, math.ceil(math.sqrt(m) * dt / (math.sqrt(12) * math.pi * precision)))


def _check_increment(dW, api: str):
    if jnp.ndim(dW) != 1:
        raise ValueError(
            f"`{api}` simulates Lévy areas of an `m`-dimensional Brownian motion given as an "
            f"array of shape `(m,)`, but the increment has shape {jnp.shape(dW)}. Create the "
            "Brownian motion with `shape=(m,)` and reshape inside the diffusion's vector "
            "field if needed."
        )


def sample_levy_area(
    key: PRNGKeyArray,
    dW: Float[Array, " m"],
    dt: Real[ScalarLike, ""],
    n_terms: int,
    *,
    method: LevyAreaMethod = "mrongowius-roessler",
) -> Float[Array, "m m"]:
    r"""Sample the Lévy area of a step of an $m$-dimensional Brownian motion, conditionally
    on its increment, by the truncated Fourier series of the Brownian bridge with (by
    default) the Gaussian tail-sum correction of Mrongowius and Rößler. The algorithm and
    its error are explained in [Simulating Lévy areas](../devdocs/levy_area.md).

    **Arguments:**

    - `key`: a JAX random key.
    - `dW`: the increment $\Delta W$ over the step, shape `(m,)`.
    - `dt`: the step size $h > 0$.
    - `n_terms`: the number $p$ of Fourier terms (a Python integer; see
      [`diffrax_linearize.levy_area_n_terms`][]). With `"mrongowius-roessler"` the error
      is $O(h / p)$ and `n_terms=0` is allowed (a Gaussian with the exact conditional
      covariance); with `"fourier"` it is $O(h / \sqrt{p})$ and `n_terms >= 1`.
    - `method`: `"mrongowius-roessler"` or `"fourier"`.

    **Returns:**

    The antisymmetric matrix $A$, shape `(m, m)`, with the dtype of `dW`.
    """
    api = "diffrax_linearize.sample_levy_area"
    _check_increment(dW, api)
    if method not in _METHODS:
        raise ValueError(f"`{api}`: `method` must be one of {_METHODS}, got {method!r}.")
    min_terms = 1 if method == "fourier" else 0
    if not isinstance(n_terms, int) or n_terms < min_terms:
        raise ValueError(
            f"`{api}`: `n_terms` must be a Python integer, at least 1 for "
            f"`method='fourier'` and at least 0 otherwise; got {n_terms!r}."
        )
    dW = jnp.asarray(dW)
    dtype = dW.dtype
    m = dW.shape[0]
    dt = jnp.asarray(dt, dtype)
    w = dW / jnp.sqrt(dt)
    key_x, key_y, key_psi, key_g = jr.split(key, 4)

    # M_ij = sum_r X_{r,i} U_{r,j} / r, one (m, p) x (p, m) product.
    r = jnp.arange(1, n_terms + 1, dtype=dtype)
    x = jr.normal(key_x, (m, n_terms), dtype)
    u = (jr.normal(key_y, (n_terms, m), dtype) - math.sqrt(2) * w) / r[:, None]
    total = x @ u
    if method == "mrongowius-roessler":
        # psi_p = sum_{r > p} 1 / r^2, computed in Python: `n_terms` is static.
        psi = math.pi**2 / 6 - sum(1 / k**2 for k in range(1, n_terms + 1))
        a = math.sqrt(2 * max(psi, 0.0))
        psi_normals = jr.normal(key_psi, (m,), dtype)
        g = jnp.triu(jr.normal(key_g, (m, m), dtype), k=1)
        # The antisymmetrisation below turns w Psi^T into w_i Psi_j - w_j Psi_i, and g
        # (upper triangular) into G_ij - G_ji with G of unit variance above the diagonal.
        total = total + a * (jnp.outer(w, psi_normals) + g)
    return (dt / (2 * math.pi)) * (total - total.T)


def sample_iterated_integrals(
    key: PRNGKeyArray,
    dW: Float[Array, " m"],
    dt: Real[ScalarLike, ""],
    n_terms: int,
    *,
    method: LevyAreaMethod = "mrongowius-roessler",
) -> IteratedIntegrals:
    r"""As [`diffrax_linearize.sample_levy_area`][], returning the increment and its
    area together as an [`diffrax_linearize.IteratedIntegrals`][] (whose `ito()` and
    `stratonovich()` give the matrices $I$ and $J$).

    **Arguments:** `key`, `dW`, `dt`, `n_terms`, `method` as for
    [`diffrax_linearize.sample_levy_area`][].

    **Returns:**

    `IteratedIntegrals(dt=dt, W=dW, A=sample_levy_area(key, dW, dt, n_terms, method=method))`.
    """
    area = sample_levy_area(key, dW, dt, n_terms, method=method)
    return IteratedIntegrals(dt=dt, W=jnp.asarray(dW), A=area)


def _step_key(key: PRNGKeyArray, t0, t1, dtype) -> PRNGKeyArray:
    """A key that depends only on `key` and the bit patterns of `t0` and `t1`."""
    # At least 32 bits, so that `bitcast_convert_type` to uint32 is defined. Not
    # `jnp.promote_types(dtype, jnp.float32)`: under `jax_numpy_dtype_promotion="strict"`
    # that raises for float64 (found by running our tests in strict mode).
    dtype = jnp.dtype(dtype)
    if dtype.itemsize < 4:
        dtype = jnp.dtype(jnp.float32)
    key = jr.fold_in(key, _LEVY_AREA_SALT)
    for t in (t0, t1):
        words = jnp.atleast_1d(lax.bitcast_convert_type(jnp.asarray(t, dtype), jnp.uint32))
        for i in range(words.shape[0]):
            key = jr.fold_in(key, words[i])
    return key


def _single_leaf(tree, what: str, api: str):
    leaves = jtu.tree_leaves(tree)
    if len(leaves) != 1:
        raise ValueError(
            f"`{api}` needs a Brownian motion with a single array of shape `(m,)`, but its "
            f"{what} is a PyTree with {len(leaves)} leaves. Use one Brownian motion of shape "
            "`(m,)` and unpack it inside the diffusion's vector field."
        )
    return leaves[0]


class LevyAreaBrownianPath(AbstractBrownianPath):
    r"""A Brownian motion that also provides the Lévy area of each step: wraps a Diffrax
    Brownian motion (typically a `diffrax.VirtualBrownianTree`) and, when evaluated
    with `use_levy=True`, samples the Lévy area over $[t_0, t_1]$ conditionally on the
    wrapped path's own increment.

    - `evaluate(t0, t1)` is exactly `bm.evaluate(t0, t1)`: a drop-in for solvers that only
      need increments, which then see the same Brownian path.
    - `evaluate(t0, t1, use_levy=True)` returns an [`diffrax_linearize.IteratedIntegrals`][]
      whose `W` is `bm.evaluate(t0, t1)` and whose `A` is sampled by
      [`diffrax_linearize.sample_levy_area`][] from a key derived deterministically from
      the key and the bit patterns of `t0` and `t1`. The same step gives the same area, so
      a solve is reproducible from the key.

    The areas of different steps are sampled independently given the increments, which is
    the exact joint law on any one grid; areas on two different grids are not related by
    Chen's relation (see [`diffrax_linearize.GridLevyAreaPath`][] for that).

    Use with [`diffrax_linearize.GeneralItoMilstein`][] or
    [`diffrax_linearize.GeneralStratonovichMilstein`][] (there is an example in the
    former's documentation):
    `diffrax.ControlTerm(g, diffrax_linearize.LevyAreaBrownianPath(bm, dt=dt))`.
    """

    bm: AbstractBrownianPath
    key: PRNGKeyArray
    n_terms: int = eqx.field(static=True)
    method: LevyAreaMethod = eqx.field(static=True)

    def __init__(
        self,
        bm: AbstractBrownianPath,
        n_terms: int | None = None,
        *,
        dt: float | None = None,
        key: PRNGKeyArray | None = None,
        method: LevyAreaMethod = "mrongowius-roessler",
    ):
        """**Arguments:**

        - `bm`: the Brownian motion, of shape `(m,)`, created with
            `levy_area=diffrax.BrownianIncrement` (the default).
        - `n_terms`: the number of Fourier terms per step; see
            [`diffrax_linearize.sample_levy_area`][].
        - `dt`: instead of `n_terms`: the (largest) step size the solver will take; then
            `n_terms = diffrax_linearize.levy_area_n_terms(m, dt)`, the fewest terms with
            an $L^2$ error of at most $h^{3/2}$.
        - `key`: the key the areas are derived from. Defaults to the key of `bm` (folded
            with a constant, so that the areas are independent of the path).
        - `method`: `"mrongowius-roessler"` (default) or `"fourier"`.
        """
        api = "diffrax_linearize.LevyAreaBrownianPath"
        if not isinstance(bm, AbstractBrownianPath):
            raise TypeError(f"`{api}` wraps a `diffrax.AbstractBrownianPath`, got {type(bm)}.")
        levy = getattr(bm, "levy_area", diffrax.BrownianIncrement)
        if levy is not diffrax.BrownianIncrement:
            raise ValueError(
                f"`{api}` samples the Lévy area conditionally on the increment alone, so it "
                f"needs `levy_area=diffrax.BrownianIncrement`, but `bm` has `levy_area="
                f"{getattr(levy, '__name__', levy)}`. Create the Brownian motion with the "
                "default `levy_area`."
            )
        shape = _single_leaf(getattr(bm, "shape", None), "shape", api)
        if len(shape.shape) != 1:
            raise ValueError(
                f"`{api}` needs a Brownian motion of shape `(m,)`, got shape {shape.shape}. "
                "Use a flat Brownian motion and reshape inside the diffusion's vector field."
            )
        m = shape.shape[0]
        if (n_terms is None) == (dt is None):
            raise ValueError(f"`{api}`: pass exactly one of `n_terms` and `dt`.")
        if n_terms is None:
            n_terms = levy_area_n_terms(m, float(dt))  # pyright: ignore[reportArgumentType]
        if key is None:
            if not hasattr(bm, "key"):
                raise ValueError(
                    f"`{api}`: `bm` has no `key` to derive the Lévy areas from; pass `key=`."
                )
            key = _single_leaf(bm.key, "key", api)  # pyright: ignore
        if method not in _METHODS:
            raise ValueError(f"`{api}`: `method` must be one of {_METHODS}, got {method!r}.")
        self.bm = bm
        self.key = key
        self.n_terms = n_terms
        self.method = method

    @property
    def t0(self):
        return self.bm.t0

    @property
    def t1(self):
        return self.bm.t1

    @property
    def levy_area(self):
        return IteratedIntegrals

    @property
    def shape(self):
        return self.bm.shape  # pyright: ignore

    @eqx.filter_jit
    def evaluate(
        self,
        t0: Real[ScalarLike, ""],
        t1: Real[ScalarLike, ""] | None = None,
        left: bool = True,
        use_levy: bool = False,
    ) -> Float[Array, " m"] | IteratedIntegrals:
        """The increment `bm.evaluate(t0, t1)`; with `use_levy=True`, an
        [`diffrax_linearize.IteratedIntegrals`][] with it and its sampled Lévy area. If
        `t1` is not given, the increment is over `[bm.t0, t0]`."""
        del left
        return self._with_increment(self.bm.evaluate(t0, t1), t0, t1, use_levy)

    def _with_increment(
        self,
        dW: Float[Array, " m"],
        t0: Real[ScalarLike, ""],
        t1: Real[ScalarLike, ""] | None,
        use_levy: bool,
    ) -> Float[Array, " m"] | IteratedIntegrals:
        """`evaluate(t0, t1, use_levy=use_levy)` given the increment `dW` of `bm` over
        `[t0, t1]`, found elsewhere (the SDE solvers carry the Brownian tree's value from
        one step to the next and descend it once per step)."""
        if not use_levy:
            return dW
        if t1 is None:
            t0, t1 = self.t0, t0
        dt = jnp.asarray(t1, dW.dtype) - jnp.asarray(t0, dW.dtype)
        key = _step_key(self.key, t0, t1, dW.dtype)
        return sample_iterated_integrals(key, dW, dt, self.n_terms, method=self.method)


class GridLevyAreaPath(AbstractBrownianPath):
    r"""A Brownian path known on a grid $t_0 < \dots < t_n$ through its increments and
    Lévy areas over each grid step, evaluated between any two grid points through Chen's
    relation

    $$A_{[s, u]} = A_{[s, t]} + A_{[t, u]} + \tfrac{1}{2}\bigl(\Delta W_{[s, t]} \otimes
    \Delta W_{[t, u]} - \Delta W_{[t, u]} \otimes \Delta W_{[s, t]}\bigr).$$

    This is how to give a solver on a coarse grid the exact iterated integrals of a path
    sampled on a fine one: for convergence studies against a fine-step reference, and for
    reusing a path sampled elsewhere. Stores the running sums, $(n + 1)(m^2 + m)$ numbers;
    each evaluation is $O(m^2)$ after a binary search for the grid points. Evaluating at
    a time that is not a grid point is an error.

    **Arguments:**

    - `ts`: the grid, increasing, shape `(n + 1,)`.
    - `dW`: the increments over the grid steps, shape `(n, m)`.
    - `levy_area`: the Lévy areas over the grid steps, shape `(n, m, m)`, antisymmetric.
    """

    ts: Float[Array, " n+1"]
    W: Float[Array, "n+1 m"]
    area: Float[Array, "n+1 m m"]

    def __init__(
        self,
        ts: Float[Array, " n+1"],
        dW: Float[Array, "n m"],
        levy_area: Float[Array, "n m m"],
    ):
        api = "diffrax_linearize.GridLevyAreaPath"
        ts, dW, levy_area = jnp.asarray(ts), jnp.asarray(dW), jnp.asarray(levy_area)
        n = ts.shape[0] - 1
        if dW.ndim != 2 or dW.shape[0] != n or levy_area.shape != (n,) + 2 * dW.shape[1:]:
            raise ValueError(
                f"`{api}` expects `ts` of shape `(n + 1,)`, `dW` of shape `(n, m)` and "
                f"`levy_area` of shape `(n, m, m)`; got {ts.shape}, {dW.shape}, "
                f"{levy_area.shape}."
            )
        zero_w = jnp.zeros((1,) + dW.shape[1:], dW.dtype)
        W = jnp.concatenate([zero_w, jnp.cumsum(dW, axis=0)])
        # Chen: A[0, t_{k+1}] = A[0, t_k] + A_k + (W_k dW_k^T - dW_k W_k^T) / 2.
        cross = 0.5 * (W[:-1, :, None] * dW[:, None, :] - dW[:, :, None] * W[:-1, None, :])
        zero_a = jnp.zeros((1,) + levy_area.shape[1:], levy_area.dtype)
        self.ts = ts
        self.W = W
        self.area = jnp.concatenate([zero_a, jnp.cumsum(levy_area + cross, axis=0)])

    @classmethod
    def from_path(cls, path: "LevyAreaBrownianPath", ts: Float[Array, " n+1"]):
        """Sample `path` (a [`diffrax_linearize.LevyAreaBrownianPath`][]) over each step of
        the grid `ts` and keep the result, so that coarser grids see those increments and
        areas combined by Chen's relation."""
        ts = jnp.asarray(ts)
        inc = jax.vmap(lambda a, b: path.evaluate(a, b, use_levy=True))(ts[:-1], ts[1:])
        return cls(ts, inc.W, inc.A)

    @property
    def t0(self):
        return self.ts[0]

    @property
    def t1(self):
        return self.ts[-1]

    @property
    def levy_area(self):
        return IteratedIntegrals

    def _index(self, t):
        t = jnp.asarray(t, self.ts.dtype)
        i = jnp.clip(jnp.searchsorted(self.ts, t), 1, self.ts.shape[0] - 1)
        i = jnp.where(jnp.abs(self.ts[i - 1] - t) < jnp.abs(self.ts[i] - t), i - 1, i)
        scale = jnp.abs(self.ts[-1] - self.ts[0])
        tol = 1e3 * jnp.finfo(self.ts.dtype).eps * scale
        return eqx.error_if(
            i,
            jnp.abs(self.ts[i] - t) > tol,
            "`diffrax_linearize.GridLevyAreaPath` can only be evaluated at its grid points; "
            "step the solver on (a subset of) the grid, e.g. with `diffrax.StepTo(ts)`.",
        )

    def evaluate(
        self,
        t0: Real[ScalarLike, ""],
        t1: Real[ScalarLike, ""] | None = None,
        left: bool = True,
        use_levy: bool = False,
    ) -> Float[Array, " m"] | IteratedIntegrals:
        """The increment over `[t0, t1]` (both grid points); with `use_levy=True`, an
        [`diffrax_linearize.IteratedIntegrals`][] with the increment and the Lévy area. If
        `t1` is not given, the increment is over `[ts[0], t0]`."""
        del left
        if t1 is None:
            t0, t1 = self.ts[0], t0
        i, j = self._index(t0), self._index(t1)
        w_i = self.W[i]
        dW = self.W[j] - w_i
        if not use_levy:
            return dW
        area = self.area[j] - self.area[i] - 0.5 * (jnp.outer(w_i, dW) - jnp.outer(dW, w_i))
        dt = self.ts[j] - self.ts[i]
        return IteratedIntegrals(dt=dt, W=dW, A=area)
