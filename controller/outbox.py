"""Alerts: pure rules (event → AlertDraft), dedupe with a cooldown, and the durable apprise outbox.

Rules: ``shape_check_failed`` (a failed check event or milestone), ``error`` milestones, ``run_failed``,
``run_lost``, ``host_key_changed``, ``host_unreachable`` (longer than N minutes), ``stall`` (no progress
for N× the recent progress interval).  ``raise_alert`` runs inside a store transaction: it drops a draft
whose (run or host, rule) fired within the cooldown, else stores the alert plus an outbox row.  The
``OutboxWorker`` delivers due outbox rows through apprise and retries with exponential backoff; rows live in
SQLite, so an alert raised while the channel (or the controller) was down is delivered later.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

from controller.settings import Settings
from controller.store import Store, Tx

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AlertDraft:
    """An alert a rule wants to raise."""

    rule: str
    severity: str  # info | warning | error | critical
    message: str
    run_id: str | None = None
    host: str | None = None

    @property
    def dedupe_key(self) -> str:
        """Cooldown key: per (run, rule), or per (host, rule) for host alerts."""
        return f"run:{self.run_id}:{self.rule}" if self.run_id else f"host:{self.host}:{self.rule}"


def rules_for_event(run: dict[str, Any], event: dict[str, Any]) -> list[AlertDraft]:
    """Alerts a journal event of ``run`` (a row with id, name, host) should raise."""
    rid, host, name = run["id"], run["host"], run.get("name") or run["id"]
    etype = event.get("type")
    out: list[AlertDraft] = []
    if etype == "milestone":
        kind, fields = event.get("kind"), event.get("fields") or {}
        if kind == "shape_check_failed":
            what = fields.get("message") or fields.get("code") or event.get("text", "")
            out.append(
                AlertDraft("shape_check_failed", "critical", f"{name}: shape check failed: {what}", rid, host)
            )
        elif kind == "error":
            cls = fields.get("class", "traceback")
            out.append(
                AlertDraft(
                    "error", "error", f"{name}: error ({cls}): {str(event.get('text', ''))[:300]}", rid, host
                )
            )
    elif etype == "check" and event.get("ok") is False:
        probs = event.get("problems") or []
        summary = "; ".join(f"{p.get('code')}: {p.get('message')}" for p in probs[:3]) or "problems found"
        out.append(
            AlertDraft(
                "shape_check_failed",
                "critical",
                f"{name}: shape check failed on {event.get('file')}: {summary}",
                rid,
                host,
            )
        )
    elif etype == "state":
        out.extend(rules_for_state(run, str(event.get("state")), event.get("reason")))
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
    """Alert when a running run's progress is overdue by ``factor``× its recent interval."""
    if run.get("state") != "running" or not run.get("last_progress_at") or not run.get("progress_interval_s"):
        return None
    quiet = now - float(run["last_progress_at"])
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


def raise_alert(tx: Tx, draft: AlertDraft, *, cooldown_s: float, deliver: bool) -> int | None:
    """Store ``draft`` unless the same key fired within the cooldown; returns the new alert id."""
    recent = tx.conn.execute(
        "SELECT 1 FROM alerts WHERE dedupe_key=? AND created_at > ? LIMIT 1",
        (draft.dedupe_key, tx.now - cooldown_s),
    ).fetchone()
    if recent:
        return None
    cur = tx.conn.execute(
        "INSERT INTO alerts(run_id, host, rule, severity, message, created_at, dedupe_key,"
        " acked, muted, delivered) VALUES (?,?,?,?,?,?,?,0,0,0)",
        (draft.run_id, draft.host, draft.rule, draft.severity, draft.message, tx.now, draft.dedupe_key),
    )
    alert_id = int(cur.lastrowid or 0)
    if deliver:
        tx.conn.execute(
            "INSERT INTO outbox(alert_id, attempts, next_attempt_at, done) VALUES (?,0,?,0)",
            (alert_id, tx.now),
        )
    tx.alert_changed(alert_id)
    return alert_id


class OutboxWorker:
    """Delivers due outbox rows through apprise; failures back off exponentially (with jitter)."""

    def __init__(self, settings: Settings, store: Store, poll_s: float = 0.5) -> None:
        self.settings = settings
        self.store = store
        self.poll_s = poll_s

    async def run_forever(self) -> None:
        """Deliver until cancelled."""
        while True:
            try:
                await self.deliver_due()
            except Exception:
                log.exception("outbox: delivery round failed")
            await asyncio.sleep(self.poll_s)

    async def deliver_due(self) -> int:
        """One round: try every due row once; returns how many were delivered."""
        now = time.time()
        rows = await self.store.read(_due, now)
        delivered = 0
        for row in rows:
            # Claim the row first: another controller process (CLI + serve) may poll the same outbox.
            claimed = await self.store.write(partial(_claim, outbox_id=row["id"], now=now))
            if not claimed:
                continue
            ok, err = await self._send(row)
            delivered += ok
            await self.store.write(partial(self._record, row=row, ok=ok, err=err))
        return delivered

    async def _send(self, row: dict[str, Any]) -> tuple[bool, str | None]:

        urls = [u.get_secret_value() for u in self.settings.apprise_urls]
        if not urls:
            return False, "no apprise_urls configured"
        ap = _apprise(urls)
        title = f"eaglewatch [{row['severity']}] {row['rule']}"
        try:
            ok = bool(await ap.async_notify(body=row["message"], title=title))
        except Exception as exc:  # apprise plugins may raise on odd input; keep the row for retry
            return False, f"{type(exc).__name__}: {exc}"
        return ok, None if ok else "apprise could not deliver to every URL"

    def _record(self, tx: Tx, row: dict[str, Any], ok: bool, err: str | None) -> None:
        if ok:
            tx.conn.execute("UPDATE outbox SET done=1, attempts=attempts+1 WHERE id=?", (row["id"],))
            tx.conn.execute("UPDATE alerts SET delivered=1 WHERE id=?", (row["alert_id"],))
            tx.alert_changed(row["alert_id"])
            return
        attempts = row["attempts"] + 1
        delay = min(2.0**attempts, self.settings.outbox_max_backoff_s) * random.uniform(0.5, 1.0)
        tx.conn.execute(
            "UPDATE outbox SET attempts=?, next_attempt_at=?, last_error=? WHERE id=?",
            (attempts, tx.now + delay, err, row["id"]),
        )


def _apprise(urls: list[str]) -> Any:
    """An Apprise object for ``urls``; apprise (heavy) is imported lazily, and its plugins, loaded on the
    first ``add``, import stdlib modules deprecated in 3.11 (imghdr): silence that here only."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import apprise

        ap = apprise.Apprise()
        for url in urls:
            ap.add(url)
    return ap


def _due(conn: Any, now: float) -> list[dict[str, Any]]:
    rows = conn.execute(
        "SELECT o.id, o.alert_id, o.attempts, a.rule, a.severity, a.message FROM outbox o"
        " JOIN alerts a ON a.id = o.alert_id WHERE o.done=0 AND a.muted=0 AND o.next_attempt_at <= ?"
        " ORDER BY o.id LIMIT 100",
        (now,),
    )
    return [dict(r) for r in rows]


def _claim(tx: Tx, outbox_id: int, now: float, lease_s: float = 60.0) -> bool:
    cur = tx.conn.execute(
        "UPDATE outbox SET next_attempt_at=? WHERE id=? AND done=0 AND next_attempt_at <= ?",
        (now + lease_s, outbox_id, now),
    )
    return cur.rowcount == 1
