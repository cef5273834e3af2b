"""One call of every sample of every op (at an odd token count, so the last block is partial),
each repeated back to back into the outputs the first is still writing, outputs in reused
memory (freed outputs back smaller calls), and the edge-case harness's layouts
(misaligned, padded and column-major inputs), for ``compute-sanitizer``
(``--tool memcheck``, ``racecheck``, ``synccheck``).  The samples cover each kernel's paths
(shared-memory reductions, counters, strided and packed layouts); an op added to a folder
is covered with no line here.  ``TKA_SANITIZE_OPS``: a comma-separated list of ops
(``module.name``) to run alone."""

import os

import torch

from tile_kernels_aot import manifest, samples

g = torch.Generator(device="cuda").manual_seed(0)
calls = 0
only = [o for o in os.environ.get("TKA_SANITIZE_OPS", "").split(",") if o]
for record in manifest.ops():
    if only and f"{record['module']}.{record['name']}" not in only:
        continue
    fn = samples.function(record)
    for sample in record["samples"]:
        if not samples.is_prebuilt(record, sample):
            continue
        tokens = samples.token_counts(record, min(sample["tokens"], 1001))[0]
        args, kwargs = samples.make_args(sample, tokens, g)
        outs = samples.outputs_by_name(record, fn(*args, **kwargs))
        # back to back: the same call again, into the outputs the first one is still writing
        fn(*args, **kwargs, **outs)
        calls += 2
    first = record["samples"][0]
    if samples.is_prebuilt(record, first):
        # each call's outputs are freed at once and back the next, smaller call (kept memory
        # is reused for requests down to half its size)
        for n in samples.token_counts(record, 256, 200, 131, 129, 7):
            args, kwargs = samples.make_args(first, n, g)
            fn(*args, **kwargs)
            calls += 1
    if samples.is_prebuilt(record, first):
        # the edge-case harness's layouts: a base one element in, padded rows, column-major
        # storage; each call runs or is refused before launch
        args, kwargs = samples.make_args(first, samples.token_counts(record, 257)[0], g)
        for index, value in enumerate(args):
            if not isinstance(value, torch.Tensor) or value.dim() != 2:
                continue
            flat = torch.empty(value.numel() + 1, dtype=value.dtype, device="cuda")
            padded = torch.empty(value.shape[0], value.shape[1] + 8, dtype=value.dtype, device="cuda")
            column_major = torch.empty(value.shape[::-1], dtype=value.dtype, device="cuda").t()
            for view in (flat[1:].view(value.shape), padded[:, : value.shape[1]], column_major):
                view.copy_(value)
                try:
                    fn(*args[:index], view, *args[index + 1:], **kwargs)
                    calls += 1
                except ValueError:
                    pass
torch.cuda.synchronize()
print(f"memcheck_ops: {calls} calls done")
