"""Bundles built apart (per arch, per shard of the table) merge into the very bundle that one
build of every arch and config writes; the merge refuses bundles that overlap, leave a gap or
come from different toolchains.  The builds share the cache (TKA_CACHE_DIR), so on a warm
cache they only lower nothing and compile nothing."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from aot.build import build, shard_table
from aot.merge import merge
from aot.table import load_table

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "aot" / "shapes" / "ci.toml"
PARTS = {"sm_90a-1of2": (["sm_90a"], (1, 2)), "sm_90a-2of2": (["sm_90a"], (2, 2)), "sm_100a": (["sm_100a"], (1, 1))}


def test_shards_partition_the_table_in_its_order():
    table = load_table(TABLE)
    shards = [shard_table(table, (i, 3)) for i in (1, 2, 3)]
    for kernel, configs in table.items():
        parts = [s[kernel] for s in shards]
        assert sorted(sum(parts, []), key=str) == sorted(configs, key=str)
        assert all(part == [cfg for cfg in configs if cfg in part] for part in parts)
    sizes = [sum(map(len, s.values())) for s in shards]
    assert max(sizes) - min(sizes) <= 1
    assert shard_table(table, (1, 1)) == table


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    pytest.importorskip("tilelang")
    root = tmp_path_factory.mktemp("bundles")
    jobs = os.cpu_count() or 1
    build(root / "whole", TABLE, ["sm_90a", "sm_100a"], jobs)
    for name, (archs, shard) in PARTS.items():
        build(root / name, TABLE, archs, jobs, shard)
    return root


def files(bundle: Path) -> dict:
    return {str(p.relative_to(bundle)): p.read_bytes() for p in bundle.rglob("*") if p.is_file()}


def manifest(bundle: Path) -> dict:
    return json.loads((bundle / "manifest.json").read_text())


def test_parts_record_their_archs_and_shard(bundles):
    assert manifest(bundles / "whole")["archs"] == ["sm_90a", "sm_100a"]
    assert "shard" not in manifest(bundles / "whole") and "shard" not in manifest(bundles / "sm_100a")
    part = manifest(bundles / "sm_90a-2of2")
    assert part["archs"] == ["sm_90a"] and part["shard"] == [2, 2]
    assert sorted(f for f in files(bundles / "sm_90a-2of2") if f.startswith("kernels/")) == sorted(
        f"kernels/{b['cubin']}" for k in part["kernels"].values() for c in k["configs"] for b in c["builds"].values())


def test_merged_parts_are_the_one_shot_build(bundles, tmp_path):
    merge([bundles / name for name in PARTS], tmp_path / "merged")
    merged, whole = files(tmp_path / "merged"), files(bundles / "whole")
    assert sorted(merged) == sorted(whole)
    assert [f for f in whole if merged[f] != whole[f]] == []


def test_merge_refuses_a_build_held_twice(bundles, tmp_path):
    with pytest.raises(ValueError, match=r"sm_100a is in two bundles: .*sm_100a and .*sm_100a"):
        merge([bundles / "sm_100a", bundles / "sm_90a-1of2", bundles / "sm_90a-2of2", bundles / "sm_100a"],
              tmp_path / "merged")


def test_merge_refuses_a_missing_build(bundles, tmp_path):
    missing = sum(map(len, shard_table(load_table(TABLE), (2, 2)).values()))  # shard 2/2's sm_90a builds
    with pytest.raises(ValueError, match=rf"sm_90a-1of2 lack {missing} builds the table calls for: .* sm_90a"):
        merge([bundles / "sm_90a-1of2"], tmp_path / "merged")


def test_merge_refuses_another_toolchain(bundles, tmp_path):
    other = tmp_path / "sm_100a-other-nvcc"
    shutil.copytree(bundles / "sm_100a", other)
    m = manifest(other)
    m["toolchain"]["nvcc"] = "12.9.0"
    (other / "manifest.json").write_text(json.dumps(m))
    result = subprocess.run([sys.executable, "-m", "aot", "merge", str(bundles / "sm_90a-1of2"),
                             str(bundles / "sm_90a-2of2"), str(other), "--out", str(tmp_path / "merged")],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 1
    assert "differ in toolchain.nvcc" in result.stderr and f"{other}: 12.9.0" in result.stderr, result.stderr
    assert not (tmp_path / "merged").exists()
