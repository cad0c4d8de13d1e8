"""Server-rendered HTML pages: dashboard, new run (with templates), run, alerts, login."""

from __future__ import annotations

import time
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import APIRouter, Form, Path, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from agent.backends import Backend
from agent.limits import MAX_SHARDS
from controller.errors import ControllerError, SpecInvalid
from controller.lifecycle import RESUMABLE_STATES
from controller.service import Controller
from controller.verdict import group_problems
from web import forms, security
from web.api import read_log_page
from web.capture_card import capture_card, layer_rms_series, sharded_capture_card
from web.middleware import CSRF_REQUIRED, ControllerDep, TemplateStoreDep, client_of, get_csrf_token
from web.run_templates import TemplateError, TemplateStore
from web.sse import TERMINAL_STATES
from web.timeline import FOLDED, passed_files, timeline_rows

router = APIRouter(include_in_schema=False)
post_router = APIRouter(include_in_schema=False, dependencies=CSRF_REQUIRED)
LOG_PAGE = 200
#: Runs on one dashboard page (the older ones are a page link away).
DASHBOARD_RUNS = 50
PERIODIC_KINDS = frozenset({"progress", "throughput", "batch_captured"})
#: Samples a run page's charts start with, at most (each chart is a few hundred pixels wide).
CHART_POINTS = 1000


def thin(points: list[Any], limit: int = CHART_POINTS) -> list[Any]:
    """At most ``limit`` of ``points``, spread evenly, the first and the last kept: a long run's samples
    would otherwise weigh megabytes in the page and in every redraw of its charts."""
    n = len(points)
    if n <= limit:
        return points
    step = (n - 1) / (limit - 1)
    return [points[round(i * step)] for i in range(limit)]


def render(request: Request, name: str, status: int = 200, **context: Any) -> HTMLResponse:
    """Render a template with the common context (CSRF token, auth flag)."""
    context.setdefault("csrf_token", get_csrf_token(request))
    context.setdefault("logged_in", request.state.session.authed)
    context.setdefault("require_auth", request.app.state.require_auth)
    context["request"] = request
    html = request.app.state.jinja.get_template(name).render(**context)
    return HTMLResponse(html, status_code=status)


def _redirect(url: str) -> RedirectResponse:
    return RedirectResponse(url, status_code=303)


@router.get("/", response_class=HTMLResponse)
async def dashboard(
    request: Request, ctl: ControllerDep, page: Annotated[int, Query(ge=1, le=10**6)] = 1
) -> HTMLResponse:
    """Hosts and runs, newest first, DASHBOARD_RUNS a page; live via /api/events."""
    hosts = await ctl.list_hosts()
    runs = await ctl.list_runs(DASHBOARD_RUNS, (page - 1) * DASHBOARD_RUNS)
    pages = max(1, -(-(await ctl.count_runs()) // DASHBOARD_RUNS))
    return render(request, "dashboard.html", hosts=hosts, runs=runs, now=time.time(), page=page, pages=pages)


@router.get("/runs/new", response_class=HTMLResponse)
async def new_run(
    request: Request,
    ctl: ControllerDep,
    store: TemplateStoreDep,
    template: str | None = None,
    again: Annotated[str | None, Query(max_length=200)] = None,
) -> HTMLResponse:
    """The run form, optionally filled from a saved template or from an earlier run's spec (``again``)."""
    values = (store.get(template) or {}) if template else {}
    if again:
        values = forms.spec_to_form((await ctl.get_run(again)).spec)
    return await _form_page(request, ctl, store, values, {}, template=template, again=again)


async def _form_page(
    request: Request,
    ctl: Controller,
    store: TemplateStore,
    values: dict[str, str],
    errors: dict[str, str],
    *,
    status: int = 200,
    template: str | None = None,
    saved: str | None = None,
    again: str | None = None,
    forecast: dict[str, Any] | None = None,
) -> HTMLResponse:
    hosts = await ctl.list_hosts()
    shown = forms.without_secret_values(values)  # a page never carries a secret back to the browser
    return render(
        request, "new_run.html", status=status, values=shown, errors=errors, hosts=hosts,
        templates=store.names(), template=template, saved=saved, help=forms.field_help(),
        general_error=errors.get(forms.GENERAL_ERROR_KEY), again=again, forecast=forecast,
    )  # fmt: skip


@post_router.post("/runs/new", response_class=HTMLResponse)
async def submit_run(request: Request, ctl: ControllerDep, store: TemplateStoreDep) -> Response:
    """Launch a run from the form; on invalid input re-show the form with errors and launch nothing."""
    form = await request.form()
    values = {k: v for k in forms.FIELDS if isinstance(v := form.get(k), str)}
    hosts = [h for h in form.getlist("host") if isinstance(h, str) and h.strip()]
    if len(hosts) > 1:  # the host multi-select: a sharded run's hosts
        values["host"] = ",".join(h.strip() for h in hosts)
    if form.get("action") == "save_template":
        name = str(form.get("template_name") or "").strip()
        try:
            store.save(name, values)
        except TemplateError as exc:
            return await _form_page(request, ctl, store, values, {"template_name": str(exc)}, status=422)
        return await _form_page(request, ctl, store, values, {}, template=name, saved=name)
    spec, errors = forms.check_form(values)
    if spec is not None and form.get("action") == "forecast":
        try:
            forecast = await ctl.forecast(spec)
        except SpecInvalid as exc:  # what only the controller knows: its hosts and their GPUs
            errors = forms.errors_by_form_field(exc.errors)
        except ControllerError as exc:  # the host cannot be reached: say so, keep the form
            errors = {forms.GENERAL_ERROR_KEY: f"no forecast: {exc.message}"}
        else:
            return await _form_page(request, ctl, store, values, {}, forecast=forecast)
    elif spec is not None:
        try:
            run_id = await ctl.create_run(spec)
        except SpecInvalid as exc:
            errors = forms.errors_by_form_field(exc.errors)
        else:
            return _redirect(f"/runs/{quote(run_id)}")
    return await _form_page(request, ctl, store, values, errors, status=422)


@router.get("/runs/{run_id}", response_class=HTMLResponse)
async def run_page(
    request: Request,
    ctl: ControllerDep,
    run_id: str,
    q: Annotated[str | None, Query(max_length=200)] = None,
    errors: bool = False,
    before: Annotated[int | None, Query(ge=0, le=2**62)] = None,
    all_milestones: bool = False,
) -> HTMLResponse:
    """One run: verdict, alerts, timeline, checks, charts, log tail."""
    run = await ctl.get_run(run_id)
    lines = await read_log_page(ctl, run_id, after=-1, before=before, limit=LOG_PAGE, q=q, errors_only=errors)
    try:
        host = await ctl.get_host(run.host)
    except Exception:  # the host may have been removed since; the run page still renders
        host = None
    progress = thin(
        [
            {"at": m.at, **{k: v for k, v in m.fields.items() if isinstance(v, (int, float))}}
            for m in run.milestones
            if m.kind in ("progress", "throughput")
        ]
    )
    unfolded = [m for m in run.milestones if m.kind not in FOLDED]
    shown = unfolded if all_milestones else timeline_window(unfolded)
    timeline = timeline_rows(
        sorted(shown + [m for m in run.milestones if m.kind in FOLDED], key=lambda m: m.seq), run.state
    )
    t0 = run.started_at or run.created_at
    out_dir = run.spec.get("output_dir")
    data = {
        "run_id": run.id, "state": run.state, "t0": t0, "progress": progress,
        "log_last": lines[-1]["offset"] if lines else -1, "terminal": run.state in TERMINAL_STATES,
        "milestone_seq": max((m.seq for m in run.milestones), default=0), "host": run.host,
        "milestone_count": len(run.milestones),
        "gpus": host.gpus if host else [],
        "output_dir": out_dir,
        "layer_rms": thin(layer_rms_series(run.milestones)),
    }  # fmt: skip
    problem_groups = group_problems(((p.code, p.file, p.message) for p in run.problems), out_dir)
    # a sharded run's milestones come from several jobs: each shard's card first, then their totals
    card = (sharded_capture_card if run.shards else capture_card)(run.spec, run.milestones)
    return render(
        request, "run.html", run=run, lines=lines, q=q or "", errors_only=errors, before=before, t0=t0,
        data=data, host=host, terminal=run.state in TERMINAL_STATES, page_size=LOG_PAGE, timeline=timeline,
        hidden_milestones=len(unfolded) - len(shown), problem_groups=problem_groups,
        passed=passed_files(run.milestones), gpu_panel=bool(host and host.gpus),
        resumable=run.state in RESUMABLE_STATES and run.backend != Backend.COMMAND and not run.resumed_by,
        card=card,
        resumable_states=RESUMABLE_STATES,
        layer_chart=card is not None or bool(data["layer_rms"]),
    )  # fmt: skip


def timeline_window(milestones: list[Any], keep_progress: int = 20, keep_other: int = 300) -> list[Any]:
    """What the timeline shows by default: the latest other milestones and only the last few progress ones
    (the chart carries all progress; a 1,000-milestone run must stay light)."""
    periodic = [m for m in milestones if m.kind in PERIODIC_KINDS][-keep_progress:]
    other = [m for m in milestones if m.kind not in PERIODIC_KINDS][-keep_other:]
    return sorted(periodic + other, key=lambda m: m.seq)


@post_router.post("/runs/{run_id}/stop")
async def stop_run(ctl: ControllerDep, run_id: str) -> Response:
    """Stop a run (the page asks for confirmation first), then show it."""
    await ctl.stop_run(run_id)
    return _redirect(f"/runs/{quote(run_id)}")


@post_router.post("/runs/{run_id}/resume")
async def resume_run(
    ctl: ControllerDep, run_id: str, shard: Annotated[int | None, Form(ge=0, le=MAX_SHARDS)] = None
) -> Response:
    """Resume a failed or stopped extraction as a new run (same spec and output directory), then show it;
    for a sharded run, only ``shard`` (a button in its shard table) or every failed shard."""
    new_id = await ctl.resume_run(run_id, shard)
    return _redirect(f"/runs/{quote(new_id)}")


@router.get("/alerts", response_class=HTMLResponse)
async def alerts_page(request: Request, ctl: ControllerDep) -> HTMLResponse:
    """Every alert with acknowledge / mute buttons."""
    return render(request, "alerts.html", alerts=await ctl.list_alerts())


@post_router.post("/alerts/{alert_id}/{action}")
async def alert_action(
    ctl: ControllerDep, alert_id: Annotated[int, Path(ge=0, le=2**63 - 1)], action: str
) -> Response:
    """Acknowledge or mute an alert, then go back to the list."""
    if action == "ack":
        await ctl.ack_alert(alert_id)
    elif action == "mute":
        await ctl.mute_alert(alert_id)
    else:
        return Response("unknown action", status_code=404)
    return _redirect("/alerts")


def login_reason(bind: str) -> str:
    """Why this server asks for a login, in words true for where it listens."""
    if security.is_loopback(bind):
        return (
            f"This eaglewatch listens on {bind} only, but every account on this machine can reach that "
            "address, so it asks for the login token it printed when it started."
        )
    return (
        f"This eaglewatch listens on {bind}, beyond this machine: enter the token it printed when it "
        "first started."
    )


def _login_form(request: Request, next: str, error: str | None, status: int = 200) -> HTMLResponse:
    return render(
        request, "login.html", status=status, next=_safe_next(next), error=error,
        reason=login_reason(request.app.state.bind),
    )  # fmt: skip


@router.get("/login", response_class=HTMLResponse)
async def login_page(request: Request, next: str = "/") -> HTMLResponse:
    """The token form."""
    return _login_form(request, next, None)


@router.get("/login/link", response_class=HTMLResponse)
async def login_link(request: Request, code: Annotated[str, Query(max_length=200)] = "") -> Response:
    """A one-time login link: a valid code logs this browser in and redirects to a clean URL."""
    if not code or not request.app.state.login_links.redeem(code):
        error = "This login link was already used or has expired: enter the token instead."
        return _login_form(request, "/", error, status=401)
    return _new_session(request, "/", authed=True)


def _new_session(request: Request, url: str, authed: bool) -> Response:
    """Go to ``url`` with a new session cookie: rotated at login (a planted cookie is never promoted) and
    at logout."""
    signer: security.Signer = request.app.state.signer
    session = signer.new_session(authed)
    if authed:
        request.app.state.sessions.add(session)
    response = _redirect(url)
    response.headers.append("set-cookie", security.session_cookie(signer, session))
    return response


@router.post("/login", response_class=HTMLResponse, dependencies=CSRF_REQUIRED)
async def login(
    request: Request, token: Annotated[str, Form(max_length=200)], next: Annotated[str, Form()] = "/"
) -> Response:
    """Check the token; on success rotate the session to a logged-in one (HttpOnly, SameSite=Strict)."""
    checker: security.TokenChecker = request.app.state.token_checker
    verdict = await checker.check(token, client_of(request.scope))
    if verdict is security.Verdict.LIMITED:
        error = "too many wrong tokens from this address; wait a minute and retry"
        return _login_form(request, next, error, status=429)
    if verdict is not security.Verdict.OK:
        return _login_form(request, next, "wrong token", status=401)
    return _new_session(request, _safe_next(next), authed=True)


@router.post("/logout", dependencies=CSRF_REQUIRED)
async def logout(request: Request) -> Response:
    """Forget the session: revoked server-side, so a copy of the cookie no longer logs anyone in."""
    request.app.state.sessions.revoke(request.state.session)
    return _new_session(request, "/login", authed=False)


def _safe_next(value: str) -> str:
    """Only same-site relative paths: never an open redirect."""
    if not value.startswith("/") or value.startswith("//") or "\\" in value or "\n" in value:
        return "/"
    return value
