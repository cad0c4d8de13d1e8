"""Run lifecycle: a pure transition table (state → event → next state), no I/O (docs/architecture.md, "Run
lifecycle", draws it and says why)."""

from __future__ import annotations

from enum import StrEnum


class RunState(StrEnum):
    """Run states (a contract: docs/architecture.md)."""

    PENDING = "pending"
    STARTING = "starting"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    STOPPED = "stopped"
    LOST = "lost"
    UNKNOWN = "unknown"


class RunEvent(StrEnum):
    """What can happen to a run."""

    LAUNCH = "launch"  # controller sends the launch request
    LAUNCH_FAILED = "launch_failed"  # agent refused / unreachable before the job existed
    LAUNCHED = "launched"  # agent replied with a pid
    JOB_PENDING = "job_pending"  # agent status / journal: waiting in a scheduler's queue (Slurm)
    JOB_RUNNING = "job_running"  # agent status / journal: running
    JOB_COMPLETED = "job_completed"
    JOB_FAILED = "job_failed"
    JOB_STOPPED = "job_stopped"
    JOB_LOST = "job_lost"
    LINK_DOWN = "link_down"


S, E = RunState, RunEvent
TERMINAL: frozenset[RunState] = frozenset({S.COMPLETED, S.FAILED, S.STOPPED, S.LOST})
#: Runs that may be resumed (an extraction that ended without finishing).
RESUMABLE_STATES = ("failed", "stopped", "lost")

_FINISH: dict[RunEvent, RunState] = {
    E.JOB_COMPLETED: S.COMPLETED,
    E.JOB_FAILED: S.FAILED,
    E.JOB_STOPPED: S.STOPPED,
    E.JOB_LOST: S.LOST,
}

TRANSITIONS: dict[RunState, dict[RunEvent, RunState]] = {
    S.PENDING: {
        E.LAUNCH: S.STARTING,
        E.LAUNCH_FAILED: S.FAILED,
        E.LINK_DOWN: S.PENDING,
        E.JOB_PENDING: S.PENDING,
        E.JOB_RUNNING: S.RUNNING,
        E.JOB_FAILED: S.FAILED,
        E.JOB_STOPPED: S.STOPPED,
        E.JOB_LOST: S.LOST,
    },
    S.STARTING: {
        E.LAUNCH_FAILED: S.FAILED,
        E.LAUNCHED: S.RUNNING,
        E.JOB_PENDING: S.PENDING,
        E.JOB_RUNNING: S.RUNNING,
        E.LINK_DOWN: S.UNKNOWN,
        **_FINISH,
    },
    S.RUNNING: {
        E.LAUNCHED: S.RUNNING,
        E.JOB_PENDING: S.PENDING,
        E.JOB_RUNNING: S.RUNNING,
        E.LINK_DOWN: S.UNKNOWN,
        **_FINISH,
    },
    S.UNKNOWN: {
        E.LAUNCHED: S.RUNNING,
        E.JOB_PENDING: S.PENDING,
        E.JOB_RUNNING: S.RUNNING,
        E.LINK_DOWN: S.UNKNOWN,
        **_FINISH,
    },
    # Terminal: only the same outcome again (a replayed journal event, a late status) is accepted.
    S.COMPLETED: {E.JOB_COMPLETED: S.COMPLETED, E.LINK_DOWN: S.COMPLETED},
    S.FAILED: {E.JOB_FAILED: S.FAILED, E.LAUNCH_FAILED: S.FAILED, E.LINK_DOWN: S.FAILED},
    S.STOPPED: {E.JOB_STOPPED: S.STOPPED, E.LINK_DOWN: S.STOPPED},
    S.LOST: {E.JOB_LOST: S.LOST, E.LINK_DOWN: S.LOST},
}

#: Agent job states (protocol ``status``/journal ``state``) → the event they mean.
AGENT_STATE_EVENTS: dict[str, RunEvent] = {
    "pending": E.JOB_PENDING,
    "running": E.JOB_RUNNING,
    "completed": E.JOB_COMPLETED,
    "failed": E.JOB_FAILED,
    "stopped": E.JOB_STOPPED,
    "lost": E.JOB_LOST,
}


class InvalidTransition(Exception):
    """An event that is not allowed in the run's current state."""

    def __init__(self, state: RunState, event: RunEvent) -> None:
        super().__init__(f"run in state {state.value!r} cannot take event {event.value!r}")
        self.state = state
        self.event = event


def next_state(state: RunState | str, event: RunEvent | str) -> RunState:
    """The state after ``event``; raises InvalidTransition naming both when not allowed."""
    st, ev = RunState(state), RunEvent(event)
    try:
        return TRANSITIONS[st][ev]
    except KeyError:
        raise InvalidTransition(st, ev) from None


def is_terminal(state: RunState | str) -> bool:
    """True for completed, failed, stopped and lost."""
    return RunState(state) in TERMINAL


def event_for_agent_state(agent_state: str) -> RunEvent:
    """Map an agent job state to a run event; raises ValueError naming an unknown state."""
    try:
        return AGENT_STATE_EVENTS[agent_state]
    except KeyError:
        raise ValueError(f"unknown agent job state {agent_state!r}") from None
