"""Fixtures for the CLI tests: the controller tests' real sshd, job script and process reaper."""

from tests.controller.conftest import job_script, reap, sshd

__all__ = ["job_script", "reap", "sshd"]
