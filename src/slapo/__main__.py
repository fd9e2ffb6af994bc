"""``python -m slapo``: the same as the ``slapo`` command."""

import sys

from .cli import main

sys.exit(main())
