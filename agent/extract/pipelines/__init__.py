"""The users' own pipelines (speculators, SpecForge): argv, forecasts, disk progress, running them."""
