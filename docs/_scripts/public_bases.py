"""A griffe extension for the API reference: a class's "Bases:" line lists only bases a
reader can look up. A private base of this package (a mixin such as the Milstein solvers'
shared `MilsteinCommon`) has no page of its own, so it is left out; its methods are
implementation, and the public bases (`diffrax.AbstractItoSolver`, ...) stay."""

import griffe


PACKAGE = "diffrax_linearize"


def _is_private(path: str) -> bool:
    parts = path.split(".")
    return parts[0] == PACKAGE and any(p.startswith("_") for p in parts[1:])


class PublicBases(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        if pkg.path != PACKAGE:
            return
        for module in _modules(pkg):
            for cls in module.classes.values():
                if not cls.is_alias:
                    cls.bases = [b for b in cls.bases if not _is_private(_canonical(b))]


def _modules(module: griffe.Module):
    yield module
    for sub in module.modules.values():
        if not sub.is_alias:
            yield from _modules(sub)


def _canonical(base) -> str:
    return getattr(base, "canonical_path", str(base))
