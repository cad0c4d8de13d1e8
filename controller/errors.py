"""Typed controller errors; each carries the HTTP status the web's single exception handler returns."""

from __future__ import annotations


class ControllerError(Exception):
    """Base of every error the controller facade raises on purpose."""

    status: int = 500
    code: str = "internal"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotFound(ControllerError):
    """A host, run or alert that does not exist."""

    status = 404
    code = "not_found"


class SpecInvalid(ControllerError):
    """A run spec (or host definition) that fails validation; ``errors`` name each bad field."""

    status = 422
    code = "invalid"

    def __init__(self, errors: list[dict[str, str]]) -> None:
        self.errors = errors
        text = "; ".join(f"{e['field']}: {e['message']}" for e in errors) or "invalid input"
        super().__init__(text)


class Conflict(ControllerError):
    """The request conflicts with current state (duplicate host, stopping a finished run…)."""

    status = 409
    code = "conflict"


class Unreachable(ControllerError):
    """The host's agent cannot be reached over SSH right now."""

    status = 503
    code = "unreachable"


class HostKeyRejected(Unreachable):
    """The host's SSH key is unknown or changed: the connection was refused."""

    code = "host_key_rejected"

    def __init__(self, message: str, fingerprint: str | None = None) -> None:
        super().__init__(message)
        self.fingerprint = fingerprint


class AgentError(ControllerError):
    """The agent answered a request with an error reply."""

    status = 502
    code = "agent_error"

    def __init__(self, agent_code: str, message: str) -> None:
        super().__init__(f"agent: {agent_code}: {message}")
        self.agent_code = agent_code
