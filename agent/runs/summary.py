"""Pure run bookkeeping: what a journal says so far (RunSummary) and the final state of an ended job."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent.backends import Backend
from agent.jobs import attached

TERMINAL = ("completed", "failed", "stopped", "lost")
#: ``error`` classes after which exit code 0 still means the run failed.
FATAL_CLASSES = frozenset(
    {"oom", "nccl", "worker_died", "engine_failed", "rpc_timeout", "segfault", "killed"}
)
#: Classes that say "something else failed first": a reason names the specific error before them.
CONSEQUENCE_CLASSES = frozenset({"engine_failed", "worker_died", "traceback"})


def milestone_event(kind: str, line: int, text: str, **fields: Any) -> dict[str, Any]:
    """A milestone journal event the agent writes itself (not one a rule found in the log)."""
    return {"type": "milestone", "kind": kind, "line": line, "rank": None, "fields": fields, "text": text}


def _describe(ms: dict[str, Any]) -> str:
    fields = ms.get("fields") or {}
    text = str(fields.get("message") or ms.get("text") or "").strip()
    exc_type = fields.get("exc_type")
    if exc_type and not text.startswith(str(exc_type)):
        text = f"{exc_type}: {text}"
    return f"{fields.get('class', 'error')}: {text[:160]}"


def _errors(summary: RunSummary) -> str:
    """The root cause (named by a wrapper, else first specific error, else first fatal, else last) and,
    if other, the last error (the wrapper, kept as context)."""
    if summary.named_root is not None:  # a root cause a wrapper named (rootcause.py); its class if classified
        fields = summary.named_root["fields"]
        cls, root_text = fields.get("root_cause_class"), str(fields.get("root_cause"))[:240]
        root_text = root_text if cls in (None, "traceback") else f"{cls}: {root_text}"
        return f"; error: {root_text}; last error: {_describe(summary.last_error or summary.named_root)}"
    root = summary.first_specific or summary.first_fatal or summary.last_error
    if root is None:
        return f"; job reported: {summary.failed_reason[:200]}" if summary.failed_reason else ""
    out = f"; error: {_describe(root)}"
    if summary.last_error is not None and summary.last_error is not root:
        out += f"; last error: {_describe(summary.last_error)}"
    return out


@dataclass
class RunSummary:
    """Facts gathered from a run's journal events, in order."""

    terminal: str | None = None
    reason: str | None = None
    last_error: dict[str, Any] | None = None
    first_fatal: dict[str, Any] | None = None
    first_specific: dict[str, Any] | None = None
    named_root: dict[str, Any] | None = None  # the first wrapper error that names its root cause
    completed_seen: bool = False
    failed_seen: bool = False
    failed_reason: str | None = None

    @classmethod
    def from_events(cls, events: list[dict[str, Any]]) -> RunSummary:
        """Replay journal events."""
        summary = cls()
        for ev in events:
            summary.observe(ev)
        return summary

    def observe(self, ev: dict[str, Any]) -> None:
        """Take one journal event into account."""
        if ev.get("type") == "state":
            if ev.get("state") in TERMINAL and self.terminal is None:
                self.terminal = str(ev["state"])
                self.reason = ev.get("reason")
        elif ev.get("type") == "milestone":
            kind = ev.get("kind")
            if kind == "error":
                self.last_error = ev
                if self.named_root is None and (ev.get("fields") or {}).get("root_cause"):
                    self.named_root = ev
                if (ev.get("fields") or {}).get("class") in FATAL_CLASSES:
                    self.first_fatal = self.first_fatal or ev
                if (ev.get("fields") or {}).get("class") not in CONSEQUENCE_CLASSES:
                    self.first_specific = self.first_specific or ev
            elif kind == "completed":
                self.completed_seen = True
            elif kind == "failed":
                self.failed_seen = True
                reason = (ev.get("fields") or {}).get("reason")
                self.failed_reason = self.failed_reason or (str(reason) if reason else None)


def final_state(
    exit_rec: dict[str, Any] | None, stop_rec: dict[str, Any] | None, summary: RunSummary, backend: str
) -> tuple[str, str]:
    """(state, reason) of an ended job; ``exit_rec`` None means its exit status is unknown (lost).

    A state file the supervisor could not write (``state_error``: the agent's disk is full) leads the reason:
    the run's record may have gaps, and a full disk is likely why the job ended as it did."""
    state, reason = _outcome(exit_rec, stop_rec, summary, backend)
    problem = (exit_rec or {}).get("state_error")
    return state, f"{problem}; {reason}" if problem else reason


def _outcome(
    exit_rec: dict[str, Any] | None, stop_rec: dict[str, Any] | None, summary: RunSummary, backend: str
) -> tuple[str, str]:
    if stop_rec is not None:
        ended = (exit_rec or {}).get("ended_at")
        requested = stop_rec.get("requested_at")
        # A job that had already ended on its own when the stop came keeps its own outcome.
        if not (
            isinstance(ended, (int, float)) and isinstance(requested, (int, float)) and ended < requested
        ):
            reason = str(stop_rec.get("reason") or "stopped by request")
            return ("failed", reason) if stop_rec.get("by") == "agent" else ("stopped", reason)
    if exit_rec is None:
        return "lost", "the job is gone and no exit status was recorded (host rebooted or supervisor killed)"
    last = _errors(summary)
    sched_state = exit_rec.get("scheduler_state")
    if sched_state not in (None, "COMPLETED"):
        # Slurm's word decides: TIMEOUT, OUT_OF_MEMORY, NODE_FAIL, CANCELLED by someone else…
        return "failed", f"{sched_state}: {exit_rec.get('scheduler_reason') or 'ended in Slurm'}{last}"
    if exit_rec.get("error"):
        return "failed", f"could not start: {exit_rec['error']}"
    if exit_rec.get("attached") and exit_rec.get("code") is None:
        return _attached_outcome(str(exit_rec["attached"]), summary)
    if exit_rec.get("signal"):
        name = exit_rec.get("signal_name") or f"signal {exit_rec['signal']}"
        return "failed", f"killed by {name}{last}"
    code = exit_rec.get("code")
    if code != 0:
        return "failed", f"exit code {code}{last}"
    if summary.first_fatal is not None:
        return "failed", f"exited 0 after a fatal error{_errors(summary)}"
    if backend != Backend.COMMAND and not summary.completed_seen:
        return "failed", "exited 0 without a completion marker"
    return "completed", "exit code 0"


#: How watching an attached job ended, in words (agent/jobs/attached.py writes the word).
_ATTACHED_ENDS = {
    attached.GONE: "the job ended",
    attached.IDLE: "watching ended after the attach's idle timeout",
    attached.DETACHED: "watching ended",
}


def _attached_outcome(how: str, summary: RunSummary) -> tuple[str, str]:
    """An attached job's end, judged by its log alone: the agent is not its parent and cannot know its
    exit status, and says so rather than invent one.  A job gone without its completion marker is lost;
    watching ended by the idle timeout or a detach keeps what the log said."""
    unknown = f"{_ATTACHED_ENDS.get(how, how)}; exit status unknown (attached: not started by eaglewatch)"
    if summary.first_fatal is not None or summary.failed_seen:
        return "failed", f"{unknown}{_errors(summary)}"
    if summary.completed_seen:
        return "completed", f"{unknown}; it printed its completion marker"
    if how == attached.GONE:
        # Killed midway (the OOM killer, a kill -9) looks just like this: never call it a success.
        return "lost", f"{unknown}; it printed no completion marker"
    return "completed", unknown
