"""Prometheus metrics for ``GET /metrics``: a per-app registry, gauges refreshed from the controller."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from controller.models import RUN_STATES
from controller.service import Controller


class Metrics:
    """The app's metrics (its own registry, so several apps in one process never clash)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "eaglewatch_http_requests", "HTTP requests served", ["method", "route", "status"],
            registry=self.registry,
        )  # fmt: skip
        self.sse_clients = Gauge("eaglewatch_sse_clients", "open event streams", registry=self.registry)
        self.runs = Gauge("eaglewatch_runs", "runs by state", ["state"], registry=self.registry)
        self.hosts = Gauge("eaglewatch_hosts", "hosts by reachability", ["reachable"], registry=self.registry)
        self.open_alerts = Gauge(
            "eaglewatch_open_alerts", "alerts neither acked nor muted", registry=self.registry
        )
        self.samples = Gauge(
            "eaglewatch_run_samples_done", "samples captured by running runs", ["run"], registry=self.registry
        )

    def observe_request(self, method: str, route: str, status: int) -> None:
        """Count one served request."""
        self.requests.labels(method, route, str(status)).inc()

    async def refresh(self, ctl: Controller) -> None:
        """Set the gauges from the controller's current view."""
        runs = await ctl.list_runs()
        counts = dict.fromkeys(RUN_STATES, 0)
        for run in runs:
            counts[run.state] = counts.get(run.state, 0) + 1
        for state, n in counts.items():
            self.runs.labels(state).set(n)
        self.samples.clear()
        for run in runs:
            done = (run.progress or {}).get("samples_done")
            if run.state == "running" and isinstance(done, (int, float)):
                self.samples.labels(run.id).set(done)
        hosts = await ctl.list_hosts()
        for flag in ("true", "false", "unknown"):
            self.hosts.labels(flag).set(0)
        for host in hosts:
            flag = "unknown" if host.reachable is None else str(bool(host.reachable)).lower()
            self.hosts.labels(flag).inc()
        alerts = await ctl.list_alerts()
        self.open_alerts.set(sum(1 for a in alerts if not (a.acked or a.muted)))


router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "metrics"}},
)
async def metrics(request: Request) -> Response:
    """Prometheus text exposition format."""
    m: Metrics = request.app.state.metrics
    await m.refresh(request.app.state.controller)
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)
