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
    spec = record["params"][i]["type"]
    if spec.get("leading"):  # leading dims allowed: only fewer dims than the least rank are refused
        with pytest.raises(ValueError, match=f"^{op}: {name} must be at least {spec['ndim']}-D"):
            _call(record, sample, set_first(lambda t: t.reshape(-1)[:1].reshape([1] * (spec["ndim"] - 1))))
    else:
        with pytest.raises(ValueError, match=f"^{op}: {name} must be {len(data.shape)}-D"):
            _call(record, sample, set_first(lambda t: t.unsqueeze(0)))
    with pytest.raises(TypeError, match=f"^{op}: missing required argument"):
        samples.function(record)()
    # well-formed CPU tensors pass every check up to the device's
    with pytest.raises(ValueError, match=f"^{op}: .* must be a CUDA tensor"):
        _call(record, sample, lambda a, k: None)


DTYPE_CASES = [pytest.param(r, s, p, id=f"{r['module']}.{r['name']}.{p['name']}") for r in manifest.ops()
               for s in r["samples"][:1] if samples.is_prebuilt(r, s)
               for p in r["params"] if p["type"]["kind"] == "dtype"]


@pytest.mark.parametrize("record,sample,param", DTYPE_CASES)
def test_dtype_parameters_take_torch_dtypes_only(record, sample, param):
    """A Dtype parameter: a torch.dtype among its choices passes (up to the device check); a
    string, an int, None or another object is a TypeError, another dtype a ValueError, each
    naming the op and the parameter."""
    op = f"{record['module']}.{record['name']}"
    name = param["name"]
    index = [p["name"] for p in record["params"]].index(name)

    def setting(value):
        def change(args, kwargs):
            if index < len(args):
                args[index] = value
            else:
                kwargs[name] = value
        return change

    for choice in param["type"]["choices"]:
        with pytest.raises(ValueError, match=f"^{op}: .* must be a CUDA tensor"):
            _call(record, sample, setting(getattr(torch, choice)))
    choices = re.escape(", ".join(f"torch.{c}" for c in param["type"]["choices"]))
    for bad, shown in ((param["type"]["choices"][0], "str"), (6, "int"), (None, "NoneType"), (torch.empty(1), "Tensor")):
        with pytest.raises(TypeError, match=f"^{op}: {name} must be a torch.dtype \\({choices}\\), got {shown}"):
            _call(record, sample, setting(bad))
    other = next(d for d in (torch.float64, torch.int32, torch.complex64) if str(d)[6:] not in param["type"]["choices"])
    with pytest.raises(ValueError, match=f"^{op}: {name} must be one of {choices}, got {re.escape(str(other))}"):
        _call(record, sample, setting(other))


def test_tensor_list_arguments_are_checked_before_any_launch():
    """mhc_multilayer_recompute's lists: type, length, matching counts, each tensor's dtype,
    rank and shape, refused with the list's name."""
    record = next((r for r in manifest.ops() if r["name"] == "mhc_multilayer_recompute"), None)
    if record is None:
        pytest.skip("this build lacks mhc_multilayer_recompute")
    from tile_kernels_aot import mhc

    n, m, h = 4, 4, 64
    r0 = torch.empty(n, m, h, dtype=torch.bfloat16)
    mix = lambda: torch.empty(n, m, 1)  # noqa: E731
    row = lambda: torch.empty(n, h, dtype=torch.bfloat16)  # noqa: E731
    comb = lambda: torch.empty(n, m, m)  # noqa: E731
    res = lambda: torch.empty(n, m, h, dtype=torch.bfloat16)  # noqa: E731

    def call(pre, outs, posts, combs, li, rs):
        return mhc.mhc_multilayer_recompute(r0, pre, outs, posts, combs, li, rs)

    cases = [
        ((mix(), [], [], [], [row()], []), TypeError, "pre_mix_list must be a list or tuple"),
        (([mix()] * 65, [], [], [], [row()] * 65, []), ValueError, "pre_mix_list has 65 tensors; at most 64"),
        (([], [], [], [], [], []), ValueError, "pre_mix_list must not be empty"),
        (([mix()] * 2, [], [], [], [row()], []), ValueError, "layer_input_list must have as many tensors"),
        (([mix()], [row()] * 2, [mix()] * 2, [comb()] * 2, [row()], [res()] * 2), ValueError,
         "layer_output_list must have num_layers"),
        (([mix()], [row()], [mix()], [], [row()], [res()]), ValueError, "comb_mix_list must have as many"),
        (([mix().double()], [], [], [], [row()], []), TypeError, "pre_mix_list must have dtype torch.float32"),
        (([mix()], [], [], [], [torch.empty(n, h + 8, dtype=torch.bfloat16)], []), ValueError,
         r"layer_input_list \[0\] must have shape"),
        (([mix()], [row()], [mix()], [torch.empty(n, m, m + 1)], [row()], [res()]), ValueError,
         r"comb_mix_list \[0\] must have shape"),
        (([mix()], [row()], [mix()], [comb()], [row()], ["x"]), TypeError, "residual_list must be a torch.Tensor"),
    ]
    for lists, error, message in cases:
        with pytest.raises(error, match=message):
            call(*lists)
    with pytest.raises(ValueError, match="must be a CUDA tensor"):  # every list check passed
        call([torch.empty(n, m)] * 2, [row()], [mix()], [comb()], [row()] * 2, [res()])
