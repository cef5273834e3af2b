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
    (the module's ``__all__``).  An op whose schema names a ``wrapper`` is exported as that
    Python function (it calls the C function)."""
    from tile_kernels_aot import _C

    family_name = module_name.rsplit(".", 1)[1]
    family = getattr(_C, family_name, None)
    if family is None:
        raise ImportError(f"{module_name}: this build has no ops of this family (built: {built()})")
    names = sorted(n for n in vars(family) if not n.startswith("_"))
    namespace.update({n: getattr(family, n) for n in names})
    namespace.update(wrappers(family_name))
    return names


def wrappers(family: str) -> dict:
    """``{name: function}`` of the ops of ``family`` whose public function is a Python wrapper."""
    import importlib

    from tile_kernels_aot import manifest

    result = {}
    for record in manifest.ops():
        if record["module"] == family and record.get("wrapper"):
            module, name = record["wrapper"].rsplit(".", 1)
            result[record["name"]] = getattr(importlib.import_module(module), name)
    return result
