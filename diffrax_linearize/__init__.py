"""Structured Jacobians of linear maps from their jaxprs, and the Diffrax solvers,
adjoints and autodiff recursions built on them."""

import importlib.metadata

# --- structure engine


# --- diffrax terms


# --- solvers


# --- adjoints


# --- squared gradients


# --- ensembles


__version__ = importlib.metadata.version("diffrax_linearize")
