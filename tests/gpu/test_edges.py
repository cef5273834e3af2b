"""The edge-case harness, run over every op of the build and its samples (a new op gets it with
no list to edit): inputs past 2^31 elements and bytes, special values, layouts, misuse, a
property-based fuzz and concurrent callers.  Every case is exact (within an op's declared
tolerance, Op.tolerance, for the outputs it names) against the reference on the
same inputs, or refused before launch with an exception that names the argument."""

import os
import threading

import pytest
import torch

from tile_kernels_aot import samples

from checks import SPECIALS, assert_bits_equal, assert_matches
from ops import OPS, function, outputs_by_name, qualname, reference

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _prebuilt(record):
    return [s for s in record["samples"] if samples.is_prebuilt(record, s)]


def _first_samples(per_token_only=False):
    """The first prebuilt sample of every op (with ``per_token_only``, of every per-token op,
    leaving out routed samples: their rows are fused positions, not the tokens the rows of the
    other arguments are)."""
    params = []
    for r in OPS:
        if per_token_only and r["token_dim"] is None:
            continue
        built = [s for s in _prebuilt(r) if not (per_token_only and s.get("routing"))]
        if built:
            params.append(pytest.param(r, built[0], id=qualname(r)))
    return params


def _all_samples():
    return [pytest.param(r, s, id=f"{qualname(r)}[{s['name']}]") for r in OPS for s in _prebuilt(r)]


def _named_args(record, args, kwargs):
    names = [p["name"] for p in record["params"]]
    return list(zip(names, args)) + list(kwargs.items())


def _assert_matches_reference(record, args, kwargs, result, what, unchecked=()):
    expected = outputs_by_name(record, reference(record)(*args, **kwargs))
    got = outputs_by_name(record, result)
    assert set(got) == set(expected), what
    for name in got:
        if name not in unchecked:
            assert_matches(record, name, got[name], expected[name], f"{what} {name}")


# ---- huge: past 2^31 elements and 2^31 bytes ---------------------------------------------

def _rows(value, start, stop, n):
    if isinstance(value, (tuple, list)):  # a quantized (data, sf) pair, a tensor list
        return type(value)(_rows(v, start, stop, n) for v in value)
    if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == n:
        return value[start:stop]
    return value


def _tensors(values):
    """The tensors among ``values``, those of (data, sf) pairs and tensor lists included."""
    for v in values:
        if isinstance(v, (tuple, list)):
            yield from _tensors(v)
        elif isinstance(v, torch.Tensor):
            yield v


def _first_tensor_arg(args):
    """Index of the first tensor argument or quantized (data, sf) pair."""
    return next(i for i, a in enumerate(args)
                if isinstance(a, torch.Tensor) or (isinstance(a, tuple) and next(_tensors(a), None) is not None))


@pytest.mark.parametrize("record,sample", _first_samples(per_token_only=True))
def test_huge_inputs_are_exact_or_refused(record, sample, gen):
    """The first tensor past 2^31 elements: rows at the start, around the 2^31-byte and
    2^31-element boundaries and at the end are exact against the reference on those rows."""
    probe, _ = samples.make_args(sample, 1, gen)
    first = next(_tensors(probe))
    row_elements, row_bytes = first.numel(), first.nbytes
    n = (2**31 // row_elements) + 300
    per_row = sum(t.nbytes for t in _tensors(probe))
    fn = function(record)
    outs = outputs_by_name(record, fn(*probe))
    per_row += sum(t.untyped_storage().nbytes() for t in outs.values())
    free, _ = torch.cuda.mem_get_info()
    if per_row * n * 1.3 > free:
        pytest.skip(f"needs {per_row * n / 2**30:.0f} GiB")
    args, kwargs = samples.make_args(sample, n, gen)
    try:
        result = outputs_by_name(record, fn(*args, **kwargs))
    except ValueError as e:  # refused: the message names the limit and the argument
        assert qualname(record) in str(e) and ("2^31" in str(e) or "too" in str(e)), str(e)
        return
    torch.cuda.synchronize()
    windows = [0, 2**31 // row_bytes - 150, 2**31 // row_elements - 150, n - 300]
    ref = reference(record)
    for start in windows:
        stop = start + 300
        part_args = [_rows(a, start, stop, n) for a in args]
        part_kwargs = {k: _rows(v, start, stop, n) for k, v in kwargs.items()}
        expected = outputs_by_name(record, ref(*part_args, **part_kwargs))
        for name, tensor in result.items():
            assert_matches(record, name, tensor[start:stop], expected[name],
                           f"{qualname(record)} {name} rows {start}:{stop} of {n}")
    del args, kwargs, result
    torch.cuda.empty_cache()


# ---- special values (checks.SPECIALS) ----------------------------------------------------

@pytest.mark.parametrize("special", sorted(SPECIALS))
@pytest.mark.parametrize("record,sample", _first_samples())
def test_special_values_match_the_reference(record, sample, special, gen):
    """NaN, +-Inf, -0.0, denormals, constant and zero rows, values at the formats' maxima in
    every float input: bit for bit against the reference (docs/ops.md states each op's NaN rule),
    but for the outputs an op declares ill-conditioned under that input (Op.ill_conditioned)."""
    tokens = samples.token_counts(record, min(sample["tokens"], 512))[0]
    args, kwargs = samples.make_args(sample, tokens, gen)
    touched = False
    for _, value in _named_args(record, args, kwargs):
        if isinstance(value, torch.Tensor) and value.dtype in FLOAT_DTYPES and value.dim() >= 2 and value.numel():
            SPECIALS[special](value)
            touched = True
    if not touched:
        pytest.skip("no float input")
    result = function(record)(*args, **kwargs)
    _assert_matches_reference(record, args, kwargs, result, f"{qualname(record)} {special}",
                              unchecked=(record.get("ill_conditioned") or {}).get(special, ()))


# ---- layouts -----------------------------------------------------------------------------

def _relayout(t, how):
    """A view of t's values in another layout (same values, same shape)."""
    if how == "misaligned":  # the base pointer one element in
        flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        view = flat[1:].view(t.shape)
    elif how.startswith("row_stride"):  # rows further apart than their length
        pad = int(how.split("+")[1])
        view = torch.empty(*t.shape[:-1], t.shape[-1] + pad, dtype=t.dtype, device=t.device)[..., : t.shape[-1]]
    elif how == "transposed":  # column-major storage
        view = torch.empty(t.shape[::-1], dtype=t.dtype, device=t.device).t()
    else:
        raise ValueError(how)
    view.copy_(t)
    return view


LAYOUTS = ["misaligned", "row_stride+8", "row_stride+64", "transposed"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("record,sample", _first_samples())
def test_layouts_are_exact_or_refused_naming_the_argument(record, sample, layout, gen):
    tokens = samples.token_counts(record, min(sample["tokens"], 256))[0]
    args, kwargs = samples.make_args(sample, tokens, gen)
    expected_result = function(record)(*args, **kwargs)
    for index, (name, value) in enumerate(_named_args(record, args, kwargs)):
        if not isinstance(value, torch.Tensor) or value.dim() != 2 or (layout == "transposed" and min(value.shape) < 2):
            continue
        moved = _relayout(value, layout)
        new_args, new_kwargs = list(args), dict(kwargs)
        if index < len(args):
            new_args[index] = moved
        else:
            new_kwargs[name] = moved
        try:
            result = function(record)(*new_args, **new_kwargs)
        except ValueError as e:
            assert f"{qualname(record)}: {name}" in str(e), f"{layout} {name}: the message must name the argument: {e}"
            continue
        want = outputs_by_name(record, expected_result)
        for out, tensor in outputs_by_name(record, result).items():
            assert_bits_equal(tensor, want[out], f"{qualname(record)} {layout} {name} -> {out}")


@pytest.mark.parametrize("record,sample", _first_samples())
def test_zero_size_inner_dims_are_empty_or_refused(record, sample, gen):
    args, kwargs = samples.make_args(sample, samples.token_counts(record, 64)[0], gen)
    first = _first_tensor_arg(args)
    pair = isinstance(args[first], tuple)
    data = args[first][0] if pair else args[first]
    shape = list(data.shape)
    shape[-1] = 0
    data = torch.empty(shape, dtype=data.dtype, device="cuda")
    args[first] = (data, *args[first][1:]) if pair else data
    try:
        result = outputs_by_name(record, function(record)(*args, **kwargs))
    except ValueError as e:
        assert qualname(record) in str(e)
        return
    assert all(t.numel() == 0 or t.is_cuda for t in result.values())


# ---- misuse ------------------------------------------------------------------------------

@pytest.mark.parametrize("record,sample", _first_samples())
def test_misuse_is_refused_and_the_context_stays_healthy(record, sample, gen):
    op = qualname(record)
    fn = function(record)
    tokens = samples.token_counts(record, 128)[0]
    args, kwargs = samples.make_args(sample, tokens, gen)
    good = samples.outputs_by_name(record, fn(*args, **kwargs))  # the out= outputs only
    inputs = [v for _, v in _named_args(record, args, kwargs) if isinstance(v, torch.Tensor)]
    for name, tensor in good.items():
        wrong = {
            "shape": (ValueError, torch.empty((tensor.shape[0] + 1, *tensor.shape[1:]), dtype=tensor.dtype, device="cuda")),
            "dtype": (TypeError, torch.empty(tensor.shape, dtype=torch.float64, device="cuda")),
            "device": (ValueError, torch.empty(tensor.shape, dtype=tensor.dtype)),
        }
        if tensor.dim() == 2 and min(tensor.shape) > 1:
            wrong["strides"] = (ValueError, torch.empty_strided(tensor.shape, tensor.stride()[::-1] if tensor.stride()[1] != 1
                                                               else (1, tensor.shape[0]), dtype=tensor.dtype, device="cuda"))
        for case, (exc, bad) in wrong.items():
            with pytest.raises(exc, match=f"^{op}: {name}"):
                fn(*args, **kwargs, **{name: bad})
        for value in inputs:  # an output over an input's memory
            if value.nbytes >= tensor.nbytes and value.dtype == tensor.dtype:
                alias = value.view(-1)[: tensor.numel()].view(tensor.shape) if tensor.is_contiguous() else None
                if alias is not None:
                    with pytest.raises(ValueError, match=f"^{op}: {name} overlaps"):
                        fn(*args, **kwargs, **{name: alias})
    with pytest.raises(TypeError, match=f"^{op}: got an unexpected keyword argument"):
        fn(*args, **kwargs, no_such_argument=1)
    first = _first_tensor_arg(args)
    with pytest.raises(TypeError, match=f"^{op}: {record['params'][first]['name']} must be"):
        fn(*args[:first], None, *args[first + 1:], **kwargs)
    tensors = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    if len(tensors) > 1:
        i, second = tensors[1]
        mixed = list(args)
        mixed[i] = second.cpu()
        with pytest.raises(ValueError, match=f"^{op}: {record['params'][i]['name']}"):
            fn(*mixed, **kwargs)
    # the context is healthy: the same call again, exact
    torch.cuda.synchronize()
    _assert_matches_reference(record, args, kwargs, fn(*args, **kwargs), f"{op} after misuse")


# ---- fuzz --------------------------------------------------------------------------------

def test_fuzz_against_the_references():
    """Random ops, samples, token counts and row paddings against the references
    (TKA_FUZZ_EXAMPLES examples, 40 by default)."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    cases = [(r, s) for r in OPS for s in _prebuilt(r)]
    if not cases:
        pytest.skip("no op in this build")

    @hypothesis.settings(max_examples=int(os.environ.get("TKA_FUZZ_EXAMPLES", "40")), deadline=None, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(case=st.sampled_from(range(len(cases))), tokens=st.integers(0, 3000),
                      pad=st.sampled_from([0, 0, 8, 64]), seed=st.integers(0, 2**31 - 1))
    def check(case, tokens, pad, seed):
        record, sample = cases[case]
        gen = torch.Generator(device="cuda").manual_seed(seed)
        args, kwargs = samples.make_args(sample, samples.token_counts(record, tokens)[0], gen)
        if pad and args and isinstance(args[0], torch.Tensor) and args[0].dim() == 2:
            args[0] = _relayout(args[0], f"row_stride+{pad}")
        try:
            result = function(record)(*args, **kwargs)
        except ValueError as e:
            assert f"{qualname(record)}: " in str(e)
            return
        _assert_matches_reference(record, args, kwargs, result, f"{qualname(record)} fuzz T={tokens} pad={pad}")

    check()


# ---- concurrency -------------------------------------------------------------------------

def test_threads_on_their_own_streams():
    """Four threads, each on its own stream, call every op's first sample and check the results."""
    cases = [(r, s) for r in OPS for s in _prebuilt(r)[:1]]
    errors = []

    def worker(seed):
        try:
            gen = torch.Generator(device="cuda").manual_seed(seed)
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                for _ in range(5):
                    for record, sample in cases:
                        args, kwargs = samples.make_args(sample, samples.token_counts(record, 300)[0], gen)
                        result = function(record)(*args, **kwargs)
                        _assert_matches_reference(record, args, kwargs, result, f"{qualname(record)} thread {seed}")
            stream.synchronize()
        except Exception as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
