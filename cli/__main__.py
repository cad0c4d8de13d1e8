"""``python -m cli …`` is ``eaglewatch …``."""

from cli.app import main

main()
