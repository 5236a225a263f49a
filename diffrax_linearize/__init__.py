"""Structured Jacobians of linear maps from their jaxprs, and the Diffrax solvers,
adjoints and autodiff recursions built on them."""

import importlib.metadata

# --- structure engine
from ._materialise import (
    materialise as materialise,
    materialise_operator as materialise_operator,
)

# --- diffrax terms
from ._term import (
    commutativity_defect as commutativity_defect,
    is_additive_noise as is_additive_noise,
    is_diagonal_noise as is_diagonal_noise,
    is_scalar_noise as is_scalar_noise,
    milstein_trace_term as milstein_trace_term,
    noise_structure as noise_structure,
    NoiseStructure as NoiseStructure,
    vf_derivative as vf_derivative,
)
# --- solvers
from ._solver.milstein import (
    ItoMilstein as ItoMilstein,
    StratonovichMilstein as StratonovichMilstein,
)

# --- adjoints
# --- squared gradients
from ._squared_grads import (
    per_example_grad_norms as per_example_grad_norms,
    sum_squared_grads as sum_squared_grads,
    value_grad_and_sum_squared_grads as value_grad_and_sum_squared_grads,
)


# --- ensembles
from ._ensemble import (
    EnsembleSolution as EnsembleSolution,
    solve_ensemble as solve_ensemble,
)


__version__ = importlib.metadata.version("diffrax_linearize")
