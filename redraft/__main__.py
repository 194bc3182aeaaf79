"""``python -m redraft``: the ``redraft`` command (:mod:`redraft.commands`)."""

import sys

from redraft.commands import main

sys.exit(main())
