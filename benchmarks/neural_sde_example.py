"""Train a small neural SDE with `diffrax_linearize.BacksolveAdjoint` and
`diffrax_linearize.StratonovichMilstein`: the worked example of `docs/neural_sde.md`.

    python -m benchmarks.neural_sde_example

Prints the loss every few steps; it decreases. Takes well under a minute on a laptop CPU.
"""

import diffrax
import diffrax_linearize as dl
import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx


class NeuralSDE(eqx.Module):
    r"""$dy = f_\theta(y)\,dt + \operatorname{diag}(\sigma \tanh(y) + b) \circ dW$.

    The diffusion is diagonal and its $i$-th entry depends on $y_i$ only, so the noise
    is commutative and Milstein's method has strong order one."""

    drift: eqx.nn.MLP
    sigma: jax.Array
    b: jax.Array

    def __init__(self, d: int, key):
        self.drift = eqx.nn.MLP(d, d, width_size=16, depth=1, activation=jnp.tanh, key=key)
        self.sigma = 0.3 * jnp.ones(d)
        self.b = 0.1 * jnp.ones(d)

    def __call__(self, y0, key, t1=1.0, dt=0.05):
        d = y0.shape[0]
        bm = diffrax.VirtualBrownianTree(0.0, t1, dt / 4, (d,), key=key)
        # The parameters go in through `args` (or as fields of the terms): a backsolve
        # adjoint differentiates `y0`, `args` and `terms`, not values closed over.
        terms = diffrax.MultiTerm(
            diffrax.ODETerm(lambda t, y, model: model.drift(y)),
            diffrax.ControlTerm(
                lambda t, y, model: lx.DiagonalLinearOperator(model.sigma * jnp.tanh(y) + model.b),
                bm,
            ),
        )
        sol = diffrax.diffeqsolve(
            terms,
            dl.StratonovichMilstein(),
            0.0,
            t1,
            dt,
            y0,
            args=self,
            adjoint=dl.BacksolveAdjoint(),
            saveat=diffrax.SaveAt(ts=jnp.array([0.5, t1])),
        )
        return sol.ys


def loss_fn(model, y0, keys, target):
    ys = jax.vmap(model, in_axes=(None, 0))(y0, keys)  # (batch, 2 save times, d)
    mean = jnp.mean(ys, axis=0)
    spread = jnp.std(ys[:, -1], axis=0)
    # Match a target mean path, and a target spread at t1.
    return jnp.sum((mean - target) ** 2) + jnp.sum((spread - 0.2) ** 2)


def main(steps: int = 30, lr: float = 0.1, batch: int = 16, seed: int = 0) -> list[float]:
    key_model, key_data = jax.random.split(jax.random.key(seed))
    d = 2
    model = NeuralSDE(d, key_model)
    y0 = jnp.array([1.0, -1.0])
    target = jnp.array([[0.5, 0.0], [0.0, 0.5]])

    @eqx.filter_jit
    def step(model, key):
        keys = jax.random.split(key, batch)
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, y0, keys, target)
        model = eqx.apply_updates(model, jax.tree.map(lambda g: -lr * g, grads))
        return model, loss

    losses = []
    for i in range(steps):
        model, loss = step(model, jax.random.fold_in(key_data, i))
        losses.append(float(loss))
        if i % 5 == 0 or i == steps - 1:
            print(f"step {i:3d}  loss {losses[-1]:.5f}")
    return losses


if __name__ == "__main__":
    losses = main()
    assert losses[-1] < 0.5 * losses[0], "the loss should have decreased"
