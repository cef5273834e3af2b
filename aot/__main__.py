"""``python -m aot build ...`` (the bundle) | ``python -m aot docs [--check]`` (the README's operator table)."""

import sys

if len(sys.argv) > 1 and sys.argv[1] == "docs":
    from aot.docs import main as docs

    sys.exit(docs(sys.argv[2:]))

from aot.build import main  # noqa: E402

sys.exit(main())
