"""``python -m redraft.bench``: the same command as ``redraft-bench``."""

import sys

from redraft.bench.cli import main

sys.exit(main())
