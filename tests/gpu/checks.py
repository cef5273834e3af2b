"""What the GPU tests check with: prebuilt configs, poisoned outputs, special input values,
bitwise comparison."""

import torch

# the edge harness's special values, written in place into a float tensor
SPECIALS = {
    "nan": lambda t: t.view(-1)[::97].fill_(float("nan")),
    "inf": lambda t: (t.view(-1)[::89].fill_(float("inf")), t.view(-1)[5::89].fill_(float("-inf"))),
    "negative_zero": lambda t: t.view(-1)[::3].fill_(-0.0),
    "denormal": lambda t: t.view(-1)[::2].mul_(1e-39),
    "all_equal_rows": lambda t: t[::2].fill_(1.75),
    "all_zero_rows": lambda t: t[::2].zero_(),
    "format_max": lambda t: (t.view(-1)[::5].fill_(448.0), t.view(-1)[1::5].fill_(-6.0)),
}


def prebuilt_configs(kernel: str) -> list:
    """The static configs of ``kernel`` this build holds (from the installed manifest)."""
    try:
        from tile_kernels_aot import manifest
    except ImportError:
        return []
    try:
        return manifest.configs(kernel)
    except FileNotFoundError:
        return []


def poisoned(shape, dtype, strides=None):
    """A CUDA tensor filled with a value no kernel writes (NaN bits / -7777)."""
    if strides is not None:
        storage = 1 + sum((s - 1) * st for s, st in zip(shape, strides)) if all(shape) else 0
        base = torch.empty(storage, dtype=dtype, device="cuda")
        t = base.as_strided(shape, strides)
        poison(base)
        return t
    t = torch.empty(shape, dtype=dtype, device="cuda")
    poison(t)
    return t


def poison(t):
    if t.dtype.is_floating_point and t.element_size() >= 2:
        t.fill_(float("nan"))
    elif t.element_size() == 1:
        t.view(torch.uint8).fill_(0x7F)  # NaN in e4m3; 0x7F in packed e2m1 / int8 data
    else:
        t.fill_(-7777)


def assert_bits_equal(actual, expected, what=""):
    """Every element, bit for bit (NaN == NaN with the same payload)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    # dense copies (a column-major [n, 1] view is "contiguous" but not dense)
    a = torch.empty(actual.shape, dtype=actual.dtype).copy_(actual.detach())
    e = torch.empty(expected.shape, dtype=expected.dtype).copy_(expected.detach())
    if a.numel() == 0:
        return
    ab = a.view(torch.uint8).view(-1, a.element_size())
    eb = e.view(torch.uint8).view(-1, e.element_size())
    bad = (ab != eb).any(dim=1)
    if bad.any():
        idx = bad.nonzero()[0].item()
        flat_a, flat_e = a.reshape(-1), e.reshape(-1)
        raise AssertionError(f"{what}: {int(bad.sum())} of {a.numel()} elements differ; first at flat index {idx}: "
                             f"{flat_a[idx].float().item() if a.dtype != torch.int64 else flat_a[idx].item()} vs "
                             f"{flat_e[idx].float().item() if e.dtype != torch.int64 else flat_e[idx].item()}")


def assert_close_to(actual, expected, rtol, atol, what=""):
    """``|actual - expected| <= rtol * |expected| + atol * max|expected|`` for every element (the
    max over the whole tensor), NaN and infinities at the same places: an op's declared
    tolerance for an output whose reference order it cannot follow (``Op.tolerance``)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    if a.numel() == 0:
        return
    special = ~torch.isfinite(e)
    assert torch.equal(~torch.isfinite(a), special), f"{what}: NaN / inf at other places than the reference's"
    assert torch.equal(a[special].nan_to_num(), e[special].nan_to_num()), f"{what}: infinities differ"
    finite = ~special
    if not finite.any():
        return
    bound = rtol * e[finite].abs() + atol * e[finite].abs().max()
    err = (a[finite] - e[finite]).abs()
    bad = err > bound
    if bad.any():
        idx = bad.nonzero()[0].item()
        raise AssertionError(f"{what}: {int(bad.sum())} of {int(finite.sum())} elements outside rtol={rtol}, "
                             f"atol={atol} of max; first: {a[finite][idx].item()} vs {e[finite][idx].item()}")


def assert_matches(record, name, actual, expected, what=""):
    """An output of op ``record`` against the reference's: within the op's declared tolerance for
    that output (``Op.tolerance``), else bit for bit."""
    tolerances = record.get("tolerance") or {}
    tolerance = tolerances.get(name, tolerances.get(name.split("[")[0]))  # a tensor list's tensor: name[k]
    if tolerance is None:
        assert_bits_equal(actual, expected, what)
    else:
        assert_close_to(actual, expected, *tolerance, what)
