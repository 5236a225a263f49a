"""Structured Jacobians of linear maps from their jaxprs, and the Diffrax solvers,
adjoints and autodiff recursions built on them."""

import importlib.metadata

from ._adjoint import BacksolveAdjoint as BacksolveAdjoint
from ._diagonal import jacobian_diagonal as jacobian_diagonal
from ._ensemble import (
    EnsembleSolution as EnsembleSolution,
    solve_ensemble as solve_ensemble,
)
from ._levy_area import (
    GridLevyAreaPath as GridLevyAreaPath,
    IteratedIntegrals as IteratedIntegrals,
    levy_area_n_terms as levy_area_n_terms,
    LevyAreaBrownianPath as LevyAreaBrownianPath,
    sample_iterated_integrals as sample_iterated_integrals,
    sample_levy_area as sample_levy_area,
)
from ._linear_solver import StructuredLinearSolver as StructuredLinearSolver
from ._materialise import (
    filter_materialise as filter_materialise,
    materialise as materialise,
    materialise_operator as materialise_operator,
    structure_report as structure_report,
    StructureReport as StructureReport,
)
from ._operators import (
    BandedLinearOperator as BandedLinearOperator,
    BlockDiagonalLinearOperator as BlockDiagonalLinearOperator,
    CSRLinearOperator as CSRLinearOperator,
    SparseLinearOperator as SparseLinearOperator,
)
from ._root_finder import Newton as Newton, VeryChord as VeryChord
from ._solver.bdf import BDF as BDF, BDFState as BDFState
from ._solver.implicit import (
    ImplicitEulerMaruyama as ImplicitEulerMaruyama,
    ImplicitItoMilstein as ImplicitItoMilstein,
    ImplicitStratonovichMilstein as ImplicitStratonovichMilstein,
)
from ._solver.milstein import (
    ItoMilstein as ItoMilstein,
    StratonovichMilstein as StratonovichMilstein,
)
from ._solver.milstein_general import (
    GeneralItoMilstein as GeneralItoMilstein,
    GeneralStratonovichMilstein as GeneralStratonovichMilstein,
)
from ._solver.rosenbrock import (
    AbstractRosenbrockW as AbstractRosenbrockW,
    Rodas4P as Rodas4P,
    Rodas5P as Rodas5P,
    ROS34PW2 as ROS34PW2,
    WState as WState,
)
from ._solver.taylor15 import ItoTaylor15 as ItoTaylor15
from ._squared_grads import (
    per_example_grad_norms as per_example_grad_norms,
    sum_squared_grads as sum_squared_grads,
    value_grad_and_sum_squared_grads as value_grad_and_sum_squared_grads,
)
from ._step_size_controller import (
    PredictiveController as PredictiveController,
    PredictiveState as PredictiveState,
)
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


try:
    __version__ = importlib.metadata.version("diffrax_linearize")
except importlib.metadata.PackageNotFoundError:  # a source checkout on `sys.path`, not installed
    __version__ = "0+unknown"
