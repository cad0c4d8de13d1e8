"""eaglewatch controller: SSH links to agents, SQLite state, run lifecycle, alerts."""

from agent import __version__

__all__ = ["__version__"]
