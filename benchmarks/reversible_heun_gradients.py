"""How far backsolve gradients through `diffrax.ReversibleHeun` are from the exact gradient
of the discrete solve, on the generator of Diffrax's neural SDE GAN example (saved at
`SaveAt(ts=...)`, so the backward pass jumps at every save time), in float64.

    python -m benchmarks.reversible_heun_gradients

Prints, for each time horizon T (step 0.1, a save time every unit of time), the relative
difference of the parameter gradients between `diffrax_linearize.BacksolveAdjoint`,
`diffrax.BacksolveAdjoint` and `diffrax.RecursiveCheckpointAdjoint` (exact for the discrete
solve). Not a timing benchmark: it writes no JSON. About a minute on 2 CPU cores.
"""

import jax


jax.config.update("jax_enable_x64", True)

import diffrax  # noqa: E402
import diffrax_linearize as dl  # noqa: E402
import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402


def lipswish(x):
    return 0.909 * jax.nn.silu(x)


class VectorField(eqx.Module):
    mlp: eqx.nn.MLP

    def __call__(self, t, y, args):
        return self.mlp(jnp.concatenate([jnp.asarray(t)[None], y]))


class ControlledVectorField(eqx.Module):
    mlp: eqx.nn.MLP
    shape: tuple[int, int] = eqx.field(static=True)

    def __call__(self, t, y, args):
        return self.mlp(jnp.concatenate([jnp.asarray(t)[None], y])).reshape(self.shape)


class Generator(eqx.Module):
    """Diffrax's neural SDE GAN generator (`examples/neural_sde.ipynb`), with the step and
    the adjoint as arguments."""

    initial: eqx.nn.MLP
    vf: VectorField
    cvf: ControlledVectorField
    readout: eqx.nn.Linear

    def __init__(self, key, data=1, initial_noise=5, noise=3, hidden=16, width=16, depth=1):
        k1, k2, k3, k4 = jr.split(key, 4)
        self.initial = eqx.nn.MLP(initial_noise, hidden, width, depth, key=k1)
        mlp = dict(width_size=width, depth=depth, activation=lipswish, final_activation=jnp.tanh)
        self.vf = VectorField(eqx.nn.MLP(hidden + 1, hidden, **mlp, key=k2))
        self.cvf = ControlledVectorField(
            eqx.nn.MLP(hidden + 1, hidden * noise, **mlp, key=k3), (hidden, noise)
        )
        self.readout = eqx.nn.Linear(hidden, data, key=k4)

    def __call__(self, ts, key, dt0, adjoint, max_steps):
        init_key, bm_key = jr.split(key)
        noise = self.cvf.shape[1]
        init = jr.normal(init_key, (self.initial.in_size,))
        bm = diffrax.VirtualBrownianTree(ts[0], ts[-1], tol=dt0 / 2, shape=(noise,), key=bm_key)
        terms = diffrax.MultiTerm(diffrax.ODETerm(self.vf), diffrax.ControlTerm(self.cvf, bm))
        sol = diffrax.diffeqsolve(
            terms,
            diffrax.ReversibleHeun(),
            ts[0],
            ts[-1],
            dt0,
            self.initial(init),
            saveat=diffrax.SaveAt(ts=ts),
            adjoint=adjoint,
            max_steps=max_steps,
        )
        return jax.vmap(self.readout)(sol.ys)


ADJOINTS = {
    "ours": dl.BacksolveAdjoint(),
    "diffrax": diffrax.BacksolveAdjoint(),
    "checkpoint": diffrax.RecursiveCheckpointAdjoint(),
}


def gradients(T: int, dt0: float = 0.1, seed: int = 0) -> dict[str, jax.Array]:
    model = Generator(jr.key(seed))
    ts = jnp.linspace(0.0, float(T), T + 1)
    key = jr.key(seed + 1)
    out = {}
    for name, adjoint in ADJOINTS.items():

        @eqx.filter_jit
        @eqx.filter_grad
        def grad(model):
            return jnp.sum(model(ts, key, dt0, adjoint, round(T / dt0) + 16) ** 2)

        leaves = jax.tree.leaves(eqx.filter(grad(model), eqx.is_inexact_array))
        out[name] = jnp.concatenate([jnp.ravel(g) for g in leaves])
    return out


def relative(a, b) -> float:
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def main(horizons=(3, 15, 63)):
    print("| T | steps | ours vs diffrax | ours vs checkpoint | diffrax vs checkpoint |")
    print("|---|---|---|---|---|")
    for T in horizons:
        g = gradients(T)
        print(
            f"| {T} | {round(T / 0.1)} | {relative(g['ours'], g['diffrax']):.3%} "
            f"| {relative(g['ours'], g['checkpoint']):.3%} "
            f"| {relative(g['diffrax'], g['checkpoint']):.3%} |"
        )


if __name__ == "__main__":
    main()
