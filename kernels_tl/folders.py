"""Discovery of the op folders: every ``kernels_tl/<family>/<op>/`` holding a ``schema.py``.

The one list everything else derives from (the build, the stubs, the manifest, and
through the manifest the package's exports, the tests and the bench).  Importing a
schema needs no TileLang.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent


@dataclass(frozen=True)
class OpFolder:
    kernel: str  # '<family>.<op>', the shape table's name for its kernel
    path: Path
    schema: object  # kernels_tl.schema.Schema

    @property
    def kernel_module(self) -> str:
        return f"kernels_tl.{self.kernel}.kernel"

    @property
    def factory_name(self) -> str:
        return f"{self.kernel.split('.')[1]}_kernel"


def op_folders() -> tuple:
    """Every op folder, sorted by kernel name.  A folder's schema must declare ``SCHEMA``,
    its ops must live in the folder's family, and it must have a ``kernel.py`` and ``host.h``."""
    folders = []
    for schema_path in sorted(ROOT.glob("*/*/schema.py")):
        path = schema_path.parent
        kernel = f"{path.parent.name}.{path.name}"
        schema = getattr(importlib.import_module(f"kernels_tl.{kernel}.schema"), "SCHEMA", None)
        where = f"kernels_tl/{path.parent.name}/{path.name}"
        if schema is None:
            raise ValueError(f"{where}/schema.py defines no SCHEMA")
        for name in ("kernel.py", "host.h"):
            if not (path / name).exists():
                raise ValueError(f"{where} has no {name}")
        for op in schema.ops:
            if op.module != path.parent.name:
                raise ValueError(f"{where}: op {op.module}.{op.name} is not in family {path.parent.name}")
        folders.append(OpFolder(kernel, path, schema))
    return tuple(folders)


def op_folder(kernel: str) -> OpFolder:
    for folder in op_folders():
        if folder.kernel == kernel:
            return folder
    raise KeyError(f"no op folder for kernel {kernel!r}")
