"""One call of every sample of every op (at an odd token count, so the last block is partial),
back-to-back calls of each op reading the previous call's output where the shapes allow, and
outputs in reused memory (freed outputs back smaller calls), for ``compute-sanitizer``
(``--tool memcheck``, ``racecheck``, ``synccheck``).  The samples cover each kernel's paths
(shared-memory reductions, counters, strided and packed layouts); an op added to a folder
is covered with no line here."""

import torch

from tile_kernels_aot import manifest, samples

g = torch.Generator(device="cuda").manual_seed(0)
calls = 0
for record in manifest.ops():
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
torch.cuda.synchronize()
print(f"memcheck_ops: {calls} calls done")
