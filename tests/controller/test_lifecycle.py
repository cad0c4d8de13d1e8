"""The run lifecycle transition table, as tables of cases."""

from __future__ import annotations

import pytest

from controller.lifecycle import (
    TERMINAL,
    TRANSITIONS,
    InvalidTransition,
    RunEvent,
    RunState,
    event_for_agent_state,
    is_terminal,
    next_state,
)

S, E = RunState, RunEvent

ALLOWED = [
    (S.PENDING, E.LAUNCH, S.STARTING),
    (S.PENDING, E.LAUNCH_FAILED, S.FAILED),
    (S.STARTING, E.LAUNCHED, S.RUNNING),
    (S.STARTING, E.LAUNCH_FAILED, S.FAILED),
    (S.STARTING, E.LINK_DOWN, S.UNKNOWN),
    (S.STARTING, E.JOB_FAILED, S.FAILED),
    (S.RUNNING, E.JOB_COMPLETED, S.COMPLETED),
    (S.RUNNING, E.JOB_FAILED, S.FAILED),
    (S.RUNNING, E.JOB_STOPPED, S.STOPPED),
    (S.RUNNING, E.JOB_LOST, S.LOST),
    (S.RUNNING, E.LINK_DOWN, S.UNKNOWN),
    (S.UNKNOWN, E.JOB_RUNNING, S.RUNNING),
    (S.UNKNOWN, E.JOB_COMPLETED, S.COMPLETED),
    (S.UNKNOWN, E.JOB_LOST, S.LOST),
    (S.COMPLETED, E.JOB_COMPLETED, S.COMPLETED),
    (S.STOPPED, E.LINK_DOWN, S.STOPPED),
    # a Slurm job waits in the queue, runs, may be requeued; it can be stopped or fail while queued
    (S.STARTING, E.JOB_PENDING, S.PENDING),
    (S.PENDING, E.JOB_RUNNING, S.RUNNING),
    (S.RUNNING, E.JOB_PENDING, S.PENDING),
    (S.PENDING, E.JOB_STOPPED, S.STOPPED),
    (S.PENDING, E.JOB_FAILED, S.FAILED),
]

REFUSED = [
    (S.PENDING, E.JOB_COMPLETED),
    (S.PENDING, E.LAUNCHED),
    (S.RUNNING, E.LAUNCH),
    (S.UNKNOWN, E.LAUNCH),
    (S.COMPLETED, E.JOB_RUNNING),
    (S.COMPLETED, E.JOB_FAILED),
    (S.FAILED, E.JOB_COMPLETED),
    (S.FAILED, E.LAUNCHED),
    (S.STOPPED, E.JOB_RUNNING),
    (S.LOST, E.JOB_RUNNING),
    (S.LOST, E.JOB_COMPLETED),
]


@pytest.mark.parametrize(("state", "event", "expected"), ALLOWED)
def test_allowed(state: RunState, event: RunEvent, expected: RunState) -> None:
    assert next_state(state, event) == expected


@pytest.mark.parametrize(("state", "event"), REFUSED)
def test_refused_names_state_and_event(state: RunState, event: RunEvent) -> None:
    with pytest.raises(InvalidTransition) as info:
        next_state(state, event)
    assert info.value.state == state and info.value.event == event
    assert state.value in str(info.value) and event.value in str(info.value)


def test_terminal_never_moves_back() -> None:
    for state in TERMINAL:
        for event, target in TRANSITIONS[state].items():
            assert target == state, (state, event)


def test_link_down_never_fails_a_run() -> None:
    for state, edges in TRANSITIONS.items():
        target = edges.get(E.LINK_DOWN)
        if state not in TERMINAL and target is not None:
            assert target in (S.UNKNOWN, S.PENDING)


@pytest.mark.parametrize(
    ("agent_state", "event"),
    [
        ("pending", E.JOB_PENDING),
        ("running", E.JOB_RUNNING),
        ("completed", E.JOB_COMPLETED),
        ("failed", E.JOB_FAILED),
        ("stopped", E.JOB_STOPPED),
        ("lost", E.JOB_LOST),
    ],
)
def test_agent_states(agent_state: str, event: RunEvent) -> None:
    assert event_for_agent_state(agent_state) == event


def test_unknown_agent_state_and_names() -> None:
    with pytest.raises(ValueError, match="exploded"):
        event_for_agent_state("exploded")
    with pytest.raises(ValueError):
        next_state("nonsense", "launch")
    assert is_terminal("lost") and not is_terminal("unknown")
