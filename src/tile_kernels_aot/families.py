"""The public families (``moe``, ``quant``, ``transpose``, ...) as this build's extension holds
them: each family module exports the ops the generated stubs registered under its name, so an
op added to a folder needs no line here or in the family module."""

from __future__ import annotations


def built() -> list:
    """The families with at least one op in the installed extension ([] without one)."""
    try:
        from tile_kernels_aot import _C
    except ImportError:
        return []
    return sorted(_C.families)


def export(module_name: str, namespace: dict) -> list:
    """Put the ops of family ``tile_kernels_aot.<family>`` into ``namespace``; returns their names
    (the module's ``__all__``)."""
    from tile_kernels_aot import _C

    family = getattr(_C, module_name.rsplit(".", 1)[1], None)
    if family is None:
        raise ImportError(f"{module_name}: this build has no ops of this family (built: {built()})")
    names = sorted(n for n in vars(family) if not n.startswith("_"))
    namespace.update({n: getattr(family, n) for n in names})
    return names
