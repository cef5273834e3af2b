"""Every op of the build on every sample of its schema, bit for bit against its PyTorch
reference (within the op's declared tolerance for the outputs it names, ``Op.tolerance``),
into poisoned out= tensors and into allocated outputs."""

import pytest
import torch

from tile_kernels_aot import manifest, samples

from checks import assert_matches, poison
from ops import function, in_place, op_samples, outputs_by_name, qualname, reference

SHIPPED_TABLE = manifest.load()["table"] == "default.toml" if manifest.ops() else False


def _call_or_skip(fn, args, kwargs, what):
    try:
        return fn(*args, **kwargs)
    except ValueError as e:
        if "no prebuilt kernel" in str(e) and not SHIPPED_TABLE:
            pytest.skip(f"{what}: not in this build's shape table")
        raise


@pytest.mark.parametrize("record,sample", op_samples())
def test_sample_matches_reference_bit_for_bit(record, sample, gen):
    fn, ref = function(record), reference(record)
    what = f"{qualname(record)} [{sample['name']}]"
    tokens = min(sample["tokens"], 4096)
    args, kwargs = samples.make_args(sample, samples.token_counts(record, tokens)[0], gen)
    result = _call_or_skip(fn, args, kwargs, what)
    allocated = outputs_by_name(record, result)
    # the reference on the same inputs, on the same device (its float functions are the GPU's)
    expected_result = ref(*args, **kwargs)
    expected = outputs_by_name(record, expected_result)
    assert set(allocated) == set(expected)
    # what a Python-wrapped op returns past its outputs (e.g. a list learnt with a host sync)
    n = len(record["returns"])
    if not in_place(record) and isinstance(expected_result, tuple) and len(expected_result) > n:
        assert isinstance(result, tuple) and len(result) == len(expected_result), f"{what}: {len(result)} values returned"
        assert list(result[n:]) == list(expected_result[n:]), f"{what}: the values past the outputs differ"
    for name, tensor in allocated.items():
        assert_matches(record, name, tensor, expected[name], f"{what} {name} (allocated)")
    if in_place(record):  # no out= outputs
        return
    # into given outputs of the same layout, poisoned: every element must be written
    given = {}
    for name, tensor in allocated.items():
        given[name] = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=tensor.device)
        poison(given[name])
    result = outputs_by_name(record, fn(*args, **kwargs, **given))
    for name, tensor in result.items():
        assert tensor is given[name], f"{what}: {name}= was not returned"
        assert_matches(record, name, tensor, expected[name], f"{what} {name} (out=)")
