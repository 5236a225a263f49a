r"""Milstein solvers for general (non-commutative) noise, with simulated iterated integrals.

One step of $\mathrm{d}y = f(t, y)\,\mathrm{d}t + g(t, y)\,\mathrm{d}W$ over $[t_0, t_1]$:

$$y_1 = y_0 + f \Delta t + g \Delta W + \sum_{j_1, j_2} (L^{j_1} g_{:, j_2})\,
I_{j_1 j_2}, \qquad L^{j} = \sum_k g_{k j} \partial_k,$$

with the iterated Itô integrals $I$ (or Stratonovich $J = I + \tfrac12 \delta h$) taken
from the control, an [`diffrax_linearize.IteratedIntegrals`][]. The double sum is the only
part whose cost depends on the structure of the diffusion; it is computed in one of two
ways (see `GeneralItoMilstein(method=...)`).
"""

from typing import Any, ClassVar, Literal, TypeAlias

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from diffrax import (
    AbstractAdaptiveSolver,
    AbstractBrownianIncrement,
    AbstractItoSolver,
    AbstractStratonovichSolver,
    AbstractTerm,
    MultiTerm,
)

from .._levy_area import IteratedIntegrals
from .._materialise import materialise
from .._term import vf_derivative
from .milstein import _RealScalarLike, _StepParts, _Y, MilsteinCommon


_Terms: TypeAlias = MultiTerm[
    tuple[AbstractTerm[Any, _RealScalarLike], AbstractTerm[Any, AbstractBrownianIncrement]]
]
ContractionMethod = Literal["auto", "contract", "jvp"]
_METHODS = ("auto", "contract", "jvp")

# `method="auto"` contracts the materialised derivative (d x m x d numbers) up to this size,
# and falls back to m JVPs above it, so that memory stays bounded.
_MAX_DERIVATIVE_ELEMENTS = 2**24


def _levy_increment(diffusion: AbstractTerm, t0, t1, name: str) -> IteratedIntegrals:
    increment = diffusion.contr(t0, t1, use_levy=True)
    if not isinstance(increment, IteratedIntegrals):
        raise TypeError(
            f"`diffrax_linearize.{name}` needs the iterated integrals of the Brownian motion "
            "over each step, but the diffusion's control returned "
            f"{type(increment).__name__} from `evaluate(t0, t1, use_levy=True)`. Wrap the "
            "Brownian motion: `diffrax.ControlTerm(g, diffrax_linearize.LevyAreaBrownianPath"
            "(bm, dt=dt0))` (or use a `diffrax_linearize.GridLevyAreaPath`)."
        )
    return increment


def _choose(method: ContractionMethod, y0, m: int) -> str:
    if method != "auto":
        return method
    leaves = jtu.tree_leaves(y0)
    if any(jnp.iscomplexobj(y) for y in leaves):
        # The structure engine, which materialises the derivative, works over the reals;
        # JVPs take complex states.
        return "jvp"
    if len(leaves) == 1 and jnp.ndim(leaves[0]) == 1:
        d = jnp.shape(leaves[0])[0]
        if d * m * d <= _MAX_DERIVATIVE_ELEMENTS:
            return "contract"
    return "jvp"


def _double_sum_contract(diffusion, t0, y0, args, integrals, dW, g_dW):
    r"""$\sum_{j_1 j_2} (L^{j_1} g_{:, j_2}) I_{j_1 j_2}$ as one contraction of the
    materialised derivative `dg[i, j2, k]` with `g[k, j1]` and `I[j1, j2]`; and the same
    with $\Delta W_{j_1} \Delta W_{j_2}$ for $I$ (what the error estimate reads), from the
    same `dg` and the step's `g_dW` $= g \Delta W$ rather than one more JVP through the
    diffusion."""
    g = materialise(diffusion, t0, y0, args)  # (d, m)
    dg = vf_derivative(diffusion, t0, y0, args)  # (d, m, d)
    # Contract g with I first (d m^2 flops), then with dg (d^2 m flops): never d m m d.
    gi = g @ integrals  # [k, j2] = sum_{j1} g[k, j1] I[j1, j2]
    with jax.numpy_dtype_promotion("standard"):
        correction = jnp.einsum("ijk,kj->i", dg, gi)
        # Under a constant step size nothing reads this and the compiler drops it. `g_dW`
        # is the step's own product, so an adaptive step forms `g @ dW` once, not twice: a
        # batched matrix product of its own in the loop of a `jax.vmap`ped solve.
        sym = jnp.einsum("ijk,kj->i", dg, jnp.outer(g_dW, dW))
    return correction, sym


def _double_sum_jvp(diffusion, t0, y0, args, integrals):
    r"""$\sum_{j_1} \partial_y (g(y) I_{j_1, :})\,[g_{:, j_1}]$: one JVP of
    $y \mapsto g(y) c$ per noise channel $j_1$, vectorised with `jax.vmap`."""
    m = integrals.shape[0]
    vf = diffusion.vf(t0, y0, args)
    eye = jnp.eye(m, dtype=integrals.dtype)

    def along(e, row):
        direction = diffusion.prod(vf, e)  # g[:, j1]
        _, out = jax.jvp(
            lambda y: diffusion.prod(diffusion.vf(t0, y, args), row), (y0,), (direction,)
        )
        return out

    outs = jax.vmap(along)(eye, integrals)
    return jtu.tree_map(lambda x: jnp.sum(x, axis=0), outs)


def _general_milstein_parts(
    name: str, ito: bool, method: ContractionMethod, terms: _Terms, t0, t1, y0, args
) -> tuple[_Y, _StepParts]:
    drift, diffusion = terms.terms
    dt = drift.contr(t0, t1)
    increment = _levy_increment(diffusion, t0, t1, name)
    dW = increment.W
    integrals = increment.ito() if ito else increment.stratonovich()

    f0_prod = drift.vf_prod(t0, y0, args, dt)
    g0_prod = diffusion.vf_prod(t0, y0, args, dW)
    how = _choose(method, y0, dW.shape[0])
    if how == "contract":
        leaves = jtu.tree_leaves(y0)
        if len(leaves) != 1 or jnp.ndim(leaves[0]) != 1:
            raise ValueError(
                f"`diffrax_linearize.{name}(method='contract')` needs a state that is one "
                "array of shape `(d,)`; use `method='jvp'` (or `'auto'`) for PyTree states."
            )
        if jnp.iscomplexobj(leaves[0]):
            raise ValueError(
                f"`diffrax_linearize.{name}(method='contract')` materialises the diffusion's "
                "derivative, which takes real states only; use `method='jvp'` (or "
                "`'auto'`) for a complex state."
            )
        (y_leaf,) = leaves
        (g_dW,) = jtu.tree_leaves(g0_prod)
        correction, sym_prod = _double_sum_contract(
            diffusion, t0, y_leaf, args, integrals, dW, g_dW
        )
        correction = jtu.tree_unflatten(jtu.tree_structure(y0), [correction])
        sym_prod = jtu.tree_unflatten(jtu.tree_structure(y0), [sym_prod])
    else:
        correction = _double_sum_jvp(diffusion, t0, y0, args, integrals)
        # Only the error estimate reads this: the symmetric double sum
        # sum_{j1, j2} (L^{j1} g_{:, j2}) dW_{j1} dW_{j2}, one JVP (see `_error_estimate`).
        direction = jtu.tree_map(lambda g, y: g.astype(jnp.result_type(y)), g0_prod, y0)
        _, sym_prod = jax.jvp(lambda _y: diffusion.vf_prod(t0, _y, args, dW), (y0,), (direction,))
    with jax.numpy_dtype_promotion("standard"):
        y1 = jtu.tree_map(
            lambda y, f, g, c: y + f + g + c.astype(jnp.result_type(y)),
            y0,
            f0_prod,
            g0_prod,
            correction,
        )
    return y1, _StepParts(dt, dW, f0_prod, g0_prod, sym_prod)


def _general_milstein_step(
    name: str, ito: bool, method: ContractionMethod, terms: _Terms, t0, t1, y0, args
) -> _Y:
    y1, _ = _general_milstein_parts(name, ito, method, terms, t0, t1, y0, args)
    return y1


def _check_method(solver):
    if solver.method not in _METHODS:
        raise ValueError(
            f"`diffrax_linearize.{type(solver).__name__}(method=...)` must be one of "
            f"{', '.join(map(repr, _METHODS))}, got {solver.method!r}."
        )


class GeneralItoMilstein(MilsteinCommon, AbstractAdaptiveSolver, AbstractItoSolver):
    r"""Milstein's method for general (non-commutative) noise; Itô version.
    Converges to the Itô solution with strong order one whatever the noise, by
    using the simulated iterated Itô integrals $I_{j_1 j_2}$ of each step. Uses local
    linear interpolation for dense/ts output.

    For the SDE $\mathrm{d}y = f(t, y)\,\mathrm{d}t + g(t, y)\,\mathrm{d}W$ with $m$
    noise channels, one step from $y_0$ over $[t_0, t_1]$ is

    $$y_1 = y_0 + f \Delta t + g \Delta W + \sum_{j_1, j_2} (L^{j_1} g_{:, j_2})\,
    I_{j_1 j_2}, \qquad L^{j} = \sum_k g_{k j} \partial_k,$$

    with $f$, $g$ evaluated at $(t_0, y_0)$. The double sum is the only part whose cost
    depends on the structure of the diffusion; `method` chooses how it is computed (see
    below).

    This should be called with `terms=MultiTerm(drift_term, diffusion_term)`, where the
    drift is a `diffrax.ODETerm` and the diffusion's control is a
    [`diffrax_linearize.LevyAreaBrownianPath`][] (or a
    [`diffrax_linearize.GridLevyAreaPath`][]) of shape `(m,)`: the solver asks it for
    `evaluate(t0, t1, use_levy=True)`, an [`diffrax_linearize.IteratedIntegrals`][].
    The strong order is one for any noise, provided the Lévy areas are accurate to
    $O(h^{3/2})$ in $L^2$ (what `LevyAreaBrownianPath(bm, dt=dt)` chooses, with `dt`
    the largest step).

    **Adaptive steps.** The step returns the embedded error estimate of
    [`diffrax_linearize.ItoMilstein`][] (the difference from the stochastic trapezoidal
    step, built on the symmetric part $\tfrac12 \Delta W \Delta W^\top$ of the iterated
    integrals, one JVP more), so it can be passed unwrapped to
    `diffrax.PIDController(rtol=..., atol=...)` with a `diffrax.VirtualBrownianTree`
    inside the `LevyAreaBrownianPath`. The Lévy area of each step is sampled given its
    increment only: the areas of a rejected step are forgotten, not carried over to the
    steps that replace it (the increments are, through the tree's Brownian bridge).
    Wrapping the solver in `diffrax.HalfSolver` raises an error: the areas of a step and
    of its two halves are not Chen-consistent, so their difference is no error estimate.

    For example, with the non-commutative noise $g(y)_{:, j} = A_j y$:

    ```python
    import diffrax
    import jax
    import jax.numpy as jnp
    import diffrax_linearize

    d, m, dt = 2, 3, 0.01
    A = jax.random.normal(jax.random.key(0), (m, d, d))
    bm = diffrax.VirtualBrownianTree(0.0, 1.0, tol=dt / 2, shape=(m,), key=jax.random.key(1))
    path = diffrax_linearize.LevyAreaBrownianPath(bm, dt=dt)
    drift = diffrax.ODETerm(lambda t, y, args: -y)
    diffusion = diffrax.ControlTerm(lambda t, y, args: jnp.einsum("jik,k->ij", A, y), path)
    terms = diffrax.MultiTerm(drift, diffusion)
    solver = diffrax_linearize.GeneralItoMilstein()
    sol = diffrax.diffeqsolve(terms, solver, 0.0, 1.0, dt, jnp.ones(d))
    ```
    """

    method: ContractionMethod = eqx.field(default="auto", static=True)

    term_structure: ClassVar = _Terms
    term_compatible_contr_kwargs: ClassVar = (dict(), dict(use_levy=True))
    fixed_steps_only: ClassVar[bool] = True

    def __check_init__(self):
        _check_method(self)

    def __init__(self, method: ContractionMethod = "auto"):
        r"""**Arguments:**

        - `method`: how the double sum of the step is computed; the result is the same
            up to rounding.

            - `"contract"`: materialise $g$ ($d \times m$, with
                [`diffrax_linearize.materialise`][]) and its state derivative
                $\partial_k g_{i j}$ ($d \times m \times d$, with
                [`diffrax_linearize.vf_derivative`][]), then contract
                $\sum_{j k} \partial_k g_{i j} (g I)_{k j}$: $d m (d + m)$ flops, and no
                $d \times m \times m$ tensor. For a diffusion linear in the state,
                $g(y)_{:, j} = A_j y$, the structure engine returns the stored $A$ as the
                derivative with no work, so the step costs little more than an
                Euler-Maruyama step. Needs a real state that is one array of shape
                `(d,)`.
            - `"jvp"`: one JVP of $y \mapsto g(y) I_{j_1, :}$ in the direction
                $g_{:, j_1}$ per noise channel $j_1$, vectorised: $m$ times the cost of
                the diffusion (for a dense linear diffusion $d^2 m^2$ flops), but works
                for any PyTree state and any `diffrax.AbstractTerm.prod`, with nothing
                materialised.
            - `"auto"` (default): `"contract"` when the state is one real array of shape
                `(d,)` and $d^2 m \le 2^{24}$, since it is then never more expensive
                and its memory stays bounded; otherwise `"jvp"`.
        """
        self.method = method

    def _y1(self, terms, t0, t1, y0, args):
        return _general_milstein_parts(
            "GeneralItoMilstein", True, self.method, terms, t0, t1, y0, args
        )


class GeneralStratonovichMilstein(
    MilsteinCommon, AbstractAdaptiveSolver, AbstractStratonovichSolver
):
    r"""Milstein's method for general (non-commutative) noise; Stratonovich version.
    Converges to the Stratonovich solution with strong order one whatever the noise, by
    using the simulated iterated Stratonovich integrals
    $J_{j_1 j_2} = I_{j_1 j_2} + \tfrac12 \delta_{j_1 j_2} h$ of each step. Uses local
    linear interpolation for dense/ts output.

    For the SDE $\mathrm{d}y = f(t, y)\,\mathrm{d}t + g(t, y)\,\mathrm{d}W$ with $m$
    noise channels, one step from $y_0$ over $[t_0, t_1]$ is

    $$y_1 = y_0 + f \Delta t + g \Delta W + \sum_{j_1, j_2} (L^{j_1} g_{:, j_2})\,
    J_{j_1 j_2}, \qquad L^{j} = \sum_k g_{k j} \partial_k,$$

    with $f$, $g$ evaluated at $(t_0, y_0)$. The double sum is the only part whose cost
    depends on the structure of the diffusion; `method` chooses how it is computed (see
    below).

    This should be called with `terms=MultiTerm(drift_term, diffusion_term)`, where the
    drift is a `diffrax.ODETerm` and the diffusion's control is a
    [`diffrax_linearize.LevyAreaBrownianPath`][] (or a
    [`diffrax_linearize.GridLevyAreaPath`][]) of shape `(m,)`: the solver asks it for
    `evaluate(t0, t1, use_levy=True)`, an [`diffrax_linearize.IteratedIntegrals`][].
    The strong order is one for any noise, provided the Lévy areas are accurate to
    $O(h^{3/2})$ in $L^2$ (what `LevyAreaBrownianPath(bm, dt=dt)` chooses, with `dt`
    the largest step).

    **Adaptive steps.** As for [`diffrax_linearize.GeneralItoMilstein`][]: the same
    embedded error estimate, so `diffrax.PIDController` works unwrapped with a
    `diffrax.VirtualBrownianTree` inside the `LevyAreaBrownianPath`; the Lévy areas of a
    rejected step are forgotten, and `diffrax.HalfSolver` raises an error.

    Used exactly as in the example of [`diffrax_linearize.GeneralItoMilstein`][], with
    `solver = diffrax_linearize.GeneralStratonovichMilstein()`.
    """

    method: ContractionMethod = eqx.field(default="auto", static=True)

    term_structure: ClassVar = _Terms
    term_compatible_contr_kwargs: ClassVar = (dict(), dict(use_levy=True))
    fixed_steps_only: ClassVar[bool] = True

    def __check_init__(self):
        _check_method(self)

    def __init__(self, method: ContractionMethod = "auto"):
        r"""**Arguments:**

        - `method`: how the double sum of the step is computed; the result is the same
            up to rounding.

            - `"contract"`: materialise $g$ ($d \times m$, with
                [`diffrax_linearize.materialise`][]) and its state derivative
                $\partial_k g_{i j}$ ($d \times m \times d$, with
                [`diffrax_linearize.vf_derivative`][]), then contract
                $\sum_{j k} \partial_k g_{i j} (g J)_{k j}$: $d m (d + m)$ flops, and no
                $d \times m \times m$ tensor. For a diffusion linear in the state,
                $g(y)_{:, j} = A_j y$, the structure engine returns the stored $A$ as the
                derivative with no work, so the step costs little more than an
                Euler-Maruyama step. Needs a real state that is one array of shape
                `(d,)`.
            - `"jvp"`: one JVP of $y \mapsto g(y) J_{j_1, :}$ in the direction
                $g_{:, j_1}$ per noise channel $j_1$, vectorised: $m$ times the cost of
                the diffusion (for a dense linear diffusion $d^2 m^2$ flops), but works
                for any PyTree state and any `diffrax.AbstractTerm.prod`, with nothing
                materialised.
            - `"auto"` (default): `"contract"` when the state is one real array of shape
                `(d,)` and $d^2 m \le 2^{24}$, since it is then never more expensive
                and its memory stays bounded; otherwise `"jvp"`.
        """
        self.method = method

    def _y1(self, terms, t0, t1, y0, args):
        return _general_milstein_parts(
            "GeneralStratonovichMilstein", False, self.method, terms, t0, t1, y0, args
        )
