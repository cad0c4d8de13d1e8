"""The JSON HTTP API (docs/architecture.md, "HTTP API") plus the SSE event streams and /metrics."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Header, Path, Query, Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt

import agent
from agent.spec import RunSpec
from controller.bus import parse_cursor
from controller.models import AlertPublic, HostCreate, HostPublic, RunDetail, RunPublic
from controller.service import Controller
from web import sse
from web.filters import masked_spec
from web.middleware import CSRF_REQUIRED, ControllerDep, CsrfTokenDep


class Health(BaseModel):
    """``GET /api/health``."""

    ok: bool
    version: str


class Created(BaseModel):
    """``POST /api/runs`` → 201."""

    id: str


class ResumeIn(BaseModel):
    """``POST /api/runs/{id}/resume``: optionally, the one shard of a sharded run to resume."""

    model_config = ConfigDict(extra="forbid")
    shard: StrictInt | None = Field(default=None, ge=0, description="resume only this shard (0-based)")


class ForecastOut(BaseModel):
    """``POST /api/forecast``: what the run would write against the free space of its output directory."""

    bytes: int
    free_bytes: int
    fits: bool
    estimated: bool
    samples: int | None = None
    tokens: int | None = None
    margin_pct: int | None = None


class FieldError(BaseModel):
    """One invalid field."""

    field: str
    message: str


class ErrorOut(BaseModel):
    """Every error response: a code, a message in words, and (422) the fields at fault."""

    error: str
    message: str
    errors: list[FieldError] | None = None


class LogLineOut(BaseModel):
    """One stored log line, keyed by its byte offset in the job's output.log."""

    offset: int
    text: str


class CsrfOut(BaseModel):
    """The CSRF token of the caller's session (send it back as ``X-CSRF-Token``)."""

    csrf_token: str


#: SQLite integers are signed 64-bit: larger ids or offsets are refused with 422, not a crash.
MAX_OFFSET = 2**62
AlertId = Annotated[int, Path(ge=0, le=2**63 - 1)]
_ERRORS: dict[int | str, dict[str, Any]] = {
    403: {"model": ErrorOut, "description": "CSRF token or Origin refused"},
    404: {"model": ErrorOut, "description": "no such host, run or alert"},
}
_SPEC_ERRORS: dict[int | str, dict[str, Any]] = {
    **_ERRORS,
    422: {"model": ErrorOut, "description": "invalid input; `errors` names each field"},
}
#: Runs per /api/runs page by default, and the most one page may ask for.
RUNS_PAGE = 100
RUNS_PAGE_MAX = 1000

router = APIRouter(prefix="/api", tags=["api"])
post_router = APIRouter(prefix="/api", tags=["api"], dependencies=CSRF_REQUIRED, responses=_ERRORS)


@router.get("/health", response_model=Health)
async def health() -> Health:
    """Liveness and version."""
    return Health(ok=True, version=agent.__version__)


@router.get("/csrf", response_model=CsrfOut)
async def csrf(token: CsrfTokenDep) -> CsrfOut:
    """The CSRF token for scripts that keep the session cookie (browsers read it from the page)."""
    return CsrfOut(csrf_token=token)


@router.get("/hosts", response_model=list[HostPublic])
async def list_hosts(ctl: ControllerDep) -> list[HostPublic]:
    """Every host with reachability and GPUs."""
    return list(await ctl.list_hosts())


@post_router.post("/hosts", response_model=HostPublic, status_code=201, responses=_SPEC_ERRORS)
async def add_host(ctl: ControllerDep, host: HostCreate) -> HostPublic:
    """Add a GPU host (reached over SSH with the user's ssh config and known_hosts)."""
    return await ctl.add_host(host)


@router.get("/hosts/{name}", response_model=HostPublic, responses=_ERRORS)
async def get_host(ctl: ControllerDep, name: str) -> HostPublic:
    """One host."""
    return await ctl.get_host(name)


@post_router.delete(
    "/hosts/{name}",
    status_code=204,
    responses={409: {"model": ErrorOut, "description": "it has active runs"}},
)
async def remove_host(ctl: ControllerDep, name: str) -> None:
    """Forget a host; 409 while it has runs that have not ended."""
    await ctl.remove_host(name)


@post_router.post("/runs", response_model=Created, status_code=201, responses=_SPEC_ERRORS)
async def create_run(ctl: ControllerDep, spec: Annotated[RunSpec, Body()]) -> Created:
    """Validate a run spec and launch it; 422 names each bad field."""
    run_id = await ctl.create_run(spec)
    return Created(id=run_id)


@post_router.post("/forecast", response_model=ForecastOut, responses=_SPEC_ERRORS)
async def forecast(ctl: ControllerDep, spec: Annotated[RunSpec, Body()]) -> ForecastOut:
    """The host's disk forecast for a run spec (its job's `--forecast`); launches nothing."""
    return ForecastOut.model_validate(await ctl.forecast(spec))


@router.get("/runs", response_model=list[RunPublic])
async def list_runs(
    ctl: ControllerDep,
    response: Response,
    limit: Annotated[int, Query(ge=1, le=RUNS_PAGE_MAX)] = RUNS_PAGE,
    offset: Annotated[int, Query(ge=0, le=2**62)] = 0,
) -> list[RunPublic]:
    """Runs, newest first, ``limit`` of them from ``offset``; header X-Total-Count: how many in all."""
    response.headers["X-Total-Count"] = str(await ctl.count_runs())
    return list(await ctl.list_runs(limit, offset))


@router.get("/runs/{run_id}", response_model=RunDetail, responses=_ERRORS)
async def get_run(ctl: ControllerDep, run_id: str) -> RunDetail:
    """One run: state, spec (secret-looking env values masked), milestones, alerts, problems."""
    result: RunDetail = await ctl.get_run(run_id)
    return result.model_copy(update={"spec": masked_spec(result.spec)})


@post_router.post("/runs/{run_id}/stop", response_model=RunPublic, responses={409: {"model": ErrorOut}})
async def stop_run(ctl: ControllerDep, run_id: str) -> RunPublic:
    """Stop a run's job (TERM, then KILL after a grace period)."""
    return await ctl.stop_run(run_id)


@post_router.post(
    "/runs/{run_id}/resume", response_model=Created, status_code=201, responses={409: {"model": ErrorOut}}
)
async def resume_run(
    ctl: ControllerDep, run_id: str, body: Annotated[ResumeIn | None, Body()] = None
) -> Created:
    """Resume a failed, stopped or lost extraction: a new run with its spec and output directory.

    A sharded run restarts its failed shards, or only ``{"shard": i}``; while it is active it stays the same
    run (the id returned is its own)."""
    return Created(id=await ctl.resume_run(run_id, body.shard if body else None))


@router.get("/runs/{run_id}/log", response_model=list[LogLineOut], responses=_ERRORS)
async def read_log(
    ctl: ControllerDep,
    run_id: str,
    after: Annotated[
        int,
        Query(ge=-1, le=MAX_OFFSET, description="byte offset: lines after it; -1: the last `limit` lines"),
    ] = -1,
    before: Annotated[
        int | None, Query(ge=0, le=MAX_OFFSET, description="page backwards: lines before this offset")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=5000)] = 500,
    q: Annotated[str | None, Query(max_length=200, description="only lines containing this text")] = None,
    errors_only: bool = False,
) -> list[dict[str, Any]]:
    """A page of the run's stored log (for the log viewer's paging and search)."""
    await ctl.get_run(run_id)
    return await read_log_page(
        ctl, run_id, after=after, before=before, limit=limit, q=q, errors_only=errors_only
    )


async def read_log_page(
    ctl: Controller,
    run_id: str,
    *,
    after: int,
    before: int | None,
    limit: int,
    q: str | None,
    errors_only: bool,
) -> list[dict[str, Any]]:
    """Lines after ``after`` (ascending; unfiltered, only those before ``before``); with ``after == -1``, or
    a filter and ``before``: the last ``limit`` lines before ``before`` (or the end)."""
    query = q or None
    if after >= 0 and (before is None or not (query or errors_only)):
        lines = await ctl.read_log(
            run_id, after_offset=after, limit=limit, query=query, errors_only=errors_only
        )
        return [ln for ln in lines if before is None or ln["offset"] < before]
    end = MAX_OFFSET if before is None else before
    return await ctl.read_log(
        run_id, after_offset=after, limit=limit, query=query, errors_only=errors_only, before_offset=end
    )


@router.get("/alerts", response_model=list[AlertPublic])
async def list_alerts(ctl: ControllerDep) -> list[AlertPublic]:
    """Every alert, newest first."""
    return list(await ctl.list_alerts())


@post_router.post("/alerts/{alert_id}/ack", response_model=AlertPublic)
async def ack_alert(ctl: ControllerDep, alert_id: AlertId) -> AlertPublic:
    """Acknowledge an alert."""
    return await ctl.ack_alert(alert_id)


@post_router.post("/alerts/{alert_id}/mute", response_model=AlertPublic)
async def mute_alert(ctl: ControllerDep, alert_id: AlertId) -> AlertPublic:
    """Mute an alert (drops its pending notification)."""
    return await ctl.mute_alert(alert_id)


_SSE_DOC = "Server-Sent Events; `id:` is a cursor: reconnect with `Last-Event-ID` (or `?after=`) to resume."


LastEventId = Annotated[str | None, Header(max_length=64)]
After = Annotated[str | None, Query(max_length=64, pattern=r"^(\d{1,20}-\d{1,20}|now)$")]


def _start(last_event_id: str | None, after: str | None) -> tuple[str | None, bool]:
    """The cursor a stream resumes from, and whether it starts from now (``?after=now``)."""
    cursor = after
    if last_event_id:
        try:
            parse_cursor(last_event_id)
            cursor = last_event_id
        except ValueError:
            pass  # a garbled Last-Event-ID restarts from the client's ?after= (or the start)
    return (None, True) if cursor == "now" else (cursor, False)


@router.get("/runs/{run_id}/events", response_class=sse.SSEResponse, responses=_ERRORS, description=_SSE_DOC)
async def run_events(
    ctl: ControllerDep, run_id: str, last_event_id: LastEventId = None, after: After = None
) -> Any:
    """Milestones, state changes, checks, alerts and log lines of one run (and its host's GPUs)."""
    run = await ctl.get_run(run_id)  # before the stream starts: an unknown run is a plain 404
    cursor, from_now = _start(last_event_id, after)
    return sse.response(sse.event_stream(ctl, run_id, cursor, host=run.host, from_now=from_now))


@router.get("/events", response_class=sse.SSEResponse, description=_SSE_DOC)
async def all_events(ctl: ControllerDep, last_event_id: LastEventId = None, after: After = None) -> Any:
    """Every run's state changes, alerts and host changes (the dashboard's live feed)."""
    cursor, from_now = _start(last_event_id, after)
    return sse.response(sse.event_stream(ctl, None, cursor, kinds=sse.DASHBOARD_KINDS, from_now=from_now))
