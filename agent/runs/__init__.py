"""One run on the host: its watcher, journal, journal summary, output-dir checks and typed spec view."""
