"""Jobs as processes: spawn detached under a supervisor, tell alive/ended/lost, stop, /proc and GPUs."""
