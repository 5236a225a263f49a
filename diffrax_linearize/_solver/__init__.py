from .rosenbrock import Rodas5P as Rodas5P
