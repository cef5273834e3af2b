"""``python -m aot build ...`` (the bundle) | ``python -m aot merge BUNDLE... --out DIR`` (one bundle
from bundles built per arch or shard) | ``python -m aot docs [--check]`` (the README's operator table)."""

import sys

if len(sys.argv) > 1 and sys.argv[1] == "docs":
    from aot.docs import main as docs

    sys.exit(docs(sys.argv[2:]))

if len(sys.argv) > 1 and sys.argv[1] == "merge":
    from aot.merge import main as merge

    sys.exit(merge(sys.argv[2:]))

from aot.build import main  # noqa: E402

sys.exit(main())
