import itertools

import jax
import pytest


# Float64 everywhere: the references (`jax.jacfwd`, per-example `vmap(grad)`, diffrax's own
# solvers) are compared to tight tolerances. Tests of float32 ask for it explicitly.
jax.config.update("jax_enable_x64", True)


@pytest.fixture
def getkey():
    """`getkey()` returns a fresh PRNG key on each call; the sequence is the same in every
    test, so failures reproduce."""
    counter = itertools.count()
    base = jax.random.key(5678)
    return lambda: jax.random.fold_in(base, next(counter))
