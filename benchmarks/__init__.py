"""Step-cost benchmarks of `diffrax_linearize` against plain `jax.jacfwd` and Diffrax.

Standalone scripts, never part of the test run. Run them with `python -m benchmarks NAME`.
"""
