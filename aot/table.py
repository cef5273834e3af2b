"""The shape table: which static configurations of which kernels to prebuild.

A table is a TOML file of ``[[kernel]]`` entries; each names a kernel
(``name = "moe.topk_gate"``) and gives every static parameter as a value or a
list of values; an entry stands for the cartesian product of its lists.
Entries for the same kernel add up; duplicates are dropped.
"""

from __future__ import annotations

import itertools
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore

SHAPES_DIR = Path(__file__).parent / "shapes"
DEFAULT_TABLE = SHAPES_DIR / "default.toml"


def load_table(path) -> dict:
    """``{kernel name: [config dict, ...]}`` in a stable order."""
    data = tomllib.loads(Path(path).read_text())
    table: dict = {}
    for i, entry in enumerate(data.get("kernel", [])):
        entry = dict(entry)
        name = entry.pop("name", None)
        if not name:
            raise ValueError(f"{path}: [[kernel]] entry {i} has no name")
        keys = sorted(entry)
        values = [v if isinstance(v, list) else [v] for v in (entry[k] for k in keys)]
        configs = table.setdefault(name, [])
        for combo in itertools.product(*values):
            config = dict(zip(keys, combo))
            if config not in configs:
                configs.append(config)
    return table


def config_key(config: dict) -> str:
    """A stable, file-name-safe key: ``num_experts=256,num_topk=8``."""
    return ",".join(f"{k}={_fmt(config[k])}" for k in sorted(config))


def _fmt(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)
