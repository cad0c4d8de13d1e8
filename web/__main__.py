"""``python -m web`` runs the ``eaglewatch`` command line."""

from web.cli import main

main()
