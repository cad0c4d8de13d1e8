"""Checks of captured hidden-state files: pure shape rules, format readers, the checker and its CLI."""
