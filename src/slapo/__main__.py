"""``python -m slapo``: the same as the ``slapo`` command."""

from .cli import console_main

console_main()
