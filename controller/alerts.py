"""Alert rules, pure: events and states in, AlertDrafts out; and the alert policy, held once per process.

Rules: ``shape_check_failed`` (a failed check event or milestone), ``error`` milestones, ``disk_low`` (a
``progress`` milestone whose job found too little free space for its output), ``layer_collapse`` (a layer
whose statistics collapsed or exploded, from the same milestones), ``canary_mismatch`` (a ``canary_checked``
milestone that is not ok), ``run_failed``,
``run_lost``, ``host_key_changed``, ``host_unreachable`` (longer than N minutes), ``stall`` (no progress
nor file check for N× the recent progress interval).  A run's alerts are kept apart per problem (a check's
problem code, an error's class), so three different problems raise three alerts and a repeated one raises one.
Storing a draft (dedupe within the cooldown, outbox row when delivering) is crud.raise_alert; delivery is
service.OutboxWorker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from controller.settings import Settings


@dataclass(frozen=True)
class AlertPolicy:
    """How raised alerts are kept: the dedupe cooldown and whether they go to the outbox."""

    cooldown_s: float
    deliver: bool

    @classmethod
    def from_settings(cls, settings: Settings) -> AlertPolicy:
        """The policy of these settings: deliver when any apprise URL is configured."""
        return cls(cooldown_s=settings.cooldown_s, deliver=bool(settings.apprise_urls))


@dataclass(frozen=True)
class AlertDraft:
    """An alert a rule wants to raise."""

    rule: str
    severity: str  # info | warning | error | critical
    message: str
    run_id: str | None = None
    host: str | None = None
    #: Which problem of its rule: a check's problem code (``non_finite``), an error's class (``oom``).
    problem: str | None = None

    @property
    def dedupe_key(self) -> str:
        """Cooldown key: per (run, rule, problem), or per (host, rule) for host alerts."""
        if not self.run_id:
            return f"host:{self.host}:{self.rule}"
        return f"run:{self.run_id}:{self.rule}" + (f":{self.problem}" if self.problem else "")


def rules_for_event(run: dict[str, Any], event: dict[str, Any]) -> list[AlertDraft]:
    """Alerts a journal event of ``run`` (a row with id, name, host) should raise."""
    rid, host, name = run["id"], run["host"], run.get("name") or run["id"]
    etype = event.get("type")
    out: list[AlertDraft] = []
    if etype == "milestone":
        kind, fields = event.get("kind"), event.get("fields") or {}
        if kind == "shape_check_failed":
            what = fields.get("message") or fields.get("code") or event.get("text", "")
            message = f"{name}: shape check failed: {what}"
            out.append(AlertDraft("shape_check_failed", "critical", message, rid, host, _code(fields)))
        elif kind == "progress":
            out.extend(_progress_alerts(name, rid, host, fields))
        elif kind == "canary_checked" and fields.get("ok") is False:
            diff, tol = fields.get("max_rel_diff"), fields.get("tolerance")
            said = f"up to {diff:.3g}" if isinstance(diff, (int, float)) else "beyond tolerance"
            message = (
                f"{name}: samples captured alone differ from their batched capture by {said} "
                f"(tolerance {tol}): batch-dependent states?"
            )
            out.append(AlertDraft("canary_mismatch", "critical", message, rid, host))
        elif kind == "error":
            cls = fields.get("class", "traceback")
            # A wrapper ("Engine core initialization failed") names its root cause (agent rootcause.py).
            root = f"{str(fields['root_cause'])[:300]} — then: " if fields.get("root_cause") else ""
            text = str(event.get("text", ""))[:300]
            message = f"{name}: error ({cls}): {root}{text}"
            out.append(AlertDraft("error", "error", message, rid, host, str(cls)))
    elif etype == "check" and event.get("ok") is False:
        out.extend(_check_alerts(name, rid, host, event))
    elif etype == "state":
        out.extend(rules_for_state(run, str(event.get("state")), event.get("reason")))
    return out


def _code(fields: dict[str, Any]) -> str | None:
    code = fields.get("code")
    return str(code) if code else None


def _check_alerts(name: str, rid: str, host: str, event: dict[str, Any]) -> list[AlertDraft]:
    """One shape_check_failed per distinct problem code of a failed check (its first three messages)."""
    by_code: dict[str | None, list[str]] = {}
    for p in event.get("problems") or []:
        if isinstance(p, dict):
            by_code.setdefault(_code(p), []).append(f"{p.get('code')}: {p.get('message')}")
    head = f"{name}: shape check failed on {event.get('file')}"
    if not by_code:
        return [AlertDraft("shape_check_failed", "critical", f"{head}: problems found", rid, host)]
    return [
        AlertDraft("shape_check_failed", "critical", f"{head}: {'; '.join(said[:3])}", rid, host, code)
        for code, said in by_code.items()
    ]


def _progress_alerts(name: str, rid: str, host: str, fields: dict[str, Any]) -> list[AlertDraft]:
    """disk_low and layer_collapse: findings the job attaches to its progress milestones."""
    out = []
    if fields.get("disk_low") is True:
        free = fields.get("free_bytes")
        gib = f"{free / 2**30:.1f} GiB" if isinstance(free, (int, float)) else "little space"
        out.append(
            AlertDraft("disk_low", "warning", f"{name}: disk low: {gib} free for the output", rid, host)
        )
    collapses = fields.get("layer_collapse")
    if isinstance(collapses, list) and collapses:
        said = "; ".join(
            f"{c.get('file', '?')}: {c.get('message', '')}" if isinstance(c, dict) else str(c)
            for c in collapses[:4]
        )
        out.append(
            AlertDraft("layer_collapse", "critical", f"{name}: layer statistics: {said}"[:500], rid, host)
        )
    return out


def rules_for_state(run: dict[str, Any], state: str, reason: Any = None) -> list[AlertDraft]:
    """Alerts a run reaching ``state`` should raise (failed, lost)."""
    name = run.get("name") or run["id"]
    why = f": {reason}" if reason else ""
    if state == "failed":
        return [
            AlertDraft("run_failed", "error", f"{name} failed on {run['host']}{why}", run["id"], run["host"])
        ]
    if state == "lost":
        return [AlertDraft("run_lost", "error", f"{name} lost on {run['host']}{why}", run["id"], run["host"])]
    return []


def host_key_changed(host: str, detail: str) -> AlertDraft:
    """The host presented a key known_hosts does not trust: connection refused."""
    return AlertDraft(
        "host_key_changed", "critical", f"host {host}: SSH host key not trusted — {detail}", None, host
    )


def host_unreachable(host: str, since: float | None, now: float, minutes: float) -> AlertDraft | None:
    """Alert once a host has been unreachable longer than ``minutes``."""
    if since is None or now - since < minutes * 60:
        return None
    return AlertDraft(
        "host_unreachable", "warning", f"host {host} unreachable for {(now - since) / 60:.1f} min", None, host
    )


def stall(run: dict[str, Any], now: float, factor: float, min_s: float) -> AlertDraft | None:
    """Alert when a running run's progress is overdue by ``factor``× its recent interval; a capture file's
    check counts as progress too (after the job's last line, its last files are still being checked)."""
    if run.get("state") != "running" or not run.get("last_progress_at") or not run.get("progress_interval_s"):
        return None
    last = max(float(run["last_progress_at"]), float(run.get("last_check_at") or 0.0))
    quiet = now - last
    limit = max(factor * float(run["progress_interval_s"]), min_s)
    if quiet < limit:
        return None
    return AlertDraft(
        "stall",
        "warning",
        f"{run.get('name') or run['id']}: no progress for {quiet:.0f}s "
        f"(usual interval {float(run['progress_interval_s']):.1f}s)",
        run["id"],
        run["host"],
    )
