"""Milestones from log lines: the pure rule engine, line anatomy, rule data (rules/*.toml) and its CLI."""
