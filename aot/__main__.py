import sys

from aot.build import main

sys.exit(main())
