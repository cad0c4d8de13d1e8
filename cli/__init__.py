"""The ``eaglewatch`` command line (typer + rich): hosts, runs, alerts, ``serve`` and ``demo``."""
