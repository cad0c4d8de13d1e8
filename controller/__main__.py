"""``python -m controller`` runs the ``eaglewatch`` command line."""

from controller.cli import main

main()
