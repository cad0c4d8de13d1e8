"""Before the engine starts: spec preflight, dataset samples, disk forecasts."""
