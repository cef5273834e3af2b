"""The checks that refuse bad arguments before anything is launched, for every op of the
installed build, on a machine without a GPU: each raises an exception that names the op and
the argument (the edge-case harness in tests/gpu covers the checks that need a device)."""

import re

import pytest
import torch

pytest.importorskip("tile_kernels_aot._C", reason="the extension is not installed")

from tile_kernels_aot import manifest, samples  # noqa: E402

CASES = [pytest.param(r, s, id=f"{r['module']}.{r['name']}") for r in manifest.ops()
         for s in r["samples"][:1] if samples.is_prebuilt(r, s)]


def _call(record, sample, change):
    args, kwargs = samples.make_args(sample, samples.token_counts(record, 64)[0], device="cpu", empty=True)
    change(args, kwargs)
    return samples.function(record)(*args, **kwargs)


def _is_pair(a):
    return isinstance(a, tuple) and len(a) == 2 and all(isinstance(t, torch.Tensor) for t in a)


def _first_tensor(record, args):
    """The first tensor argument, or a quantized ``(data, sf)`` pair (whose data is changed)."""
    return next(i for i, a in enumerate(args) if isinstance(a, torch.Tensor) or _is_pair(a))


@pytest.mark.parametrize("record,sample", CASES)
def test_bad_arguments_are_refused_by_name(record, sample):
    op = f"{record['module']}.{record['name']}"
    args, _ = samples.make_args(sample, 1, device="cpu", empty=True)
    i = _first_tensor(record, args)
    name = record["params"][i]["name"]
    pair = _is_pair(args[i])
    data = args[i][0] if pair else args[i]
    expected = "a (data, sf) pair" if pair and not record["params"][i]["type"].get("plain_dtypes") else "a torch.Tensor"

    def set_first(value, whole=False):
        def change(args, kwargs):
            args[i] = value(args[i]) if whole or not pair else (value(args[i][0]), args[i][1])
        return change

    with pytest.raises(TypeError, match=f"^{op}: got an unexpected keyword argument 'no_such_argument'"):
        _call(record, sample, lambda a, k: k.update(no_such_argument=1))
    refused = "^" + re.escape(f"{op}: {name} must be {expected}") + ".* got "
    with pytest.raises(TypeError, match=refused + "None"):
        _call(record, sample, set_first(lambda t: None, whole=True))
    with pytest.raises(TypeError, match=refused + "list"):
        _call(record, sample, set_first(lambda t: [1.0], whole=True))
    with pytest.raises(TypeError, match=f"^{op}: {name} must have dtype"):
        _call(record, sample, set_first(lambda t: t.to(torch.float64)))
    with pytest.raises(ValueError, match=f"^{op}: {name} must be {len(data.shape)}-D"):
        _call(record, sample, set_first(lambda t: t.unsqueeze(0)))
    with pytest.raises(TypeError, match=f"^{op}: missing required argument"):
        samples.function(record)()
    # well-formed CPU tensors pass every check up to the device's
    with pytest.raises(ValueError, match=f"^{op}: .* must be a CUDA tensor"):
        _call(record, sample, lambda a, k: None)
