from .rosenbrock import (
    Rodas4P as Rodas4P,
    Rodas5P as Rodas5P,
)
