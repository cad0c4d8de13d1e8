"""The Hosts page (each host, its GPUs and runs; remove one) and the Add-host form."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from pydantic import ValidationError

from controller.errors import Conflict, ControllerError
from controller.lifecycle import is_terminal
from controller.models import HostCreate, RunPublic
from controller.service import Controller
from web import forms
from web.middleware import CSRF_REQUIRED, ControllerDep
from web.pages import render

router = APIRouter(include_in_schema=False)
post_router = APIRouter(include_in_schema=False, dependencies=CSRF_REQUIRED)
#: Form fields; ``sbatch_args`` holds one option a line.
FIELDS = ("name", "ssh", "python", "scheduler", "partition", "account", "sbatch_args", "slurm_gpus")
HostName = Annotated[str, Path(max_length=200)]


def form_to_host(values: dict[str, str]) -> tuple[HostCreate | None, dict[str, str]]:
    """The host a filled form describes, or the errors by field."""
    data: dict[str, object] = {k: v.strip() for k, v in values.items() if k != "sbatch_args" and v.strip()}
    data["sbatch_args"] = [ln.strip() for ln in values.get("sbatch_args", "").splitlines() if ln.strip()]
    if data.get("scheduler") == "none":
        data.pop("scheduler")
    try:
        return HostCreate.model_validate(data), {}
    except ValidationError as exc:
        errors: dict[str, str] = {}
        for err in forms.validation_errors(exc):
            head = err["field"].split(".")[0]
            key = head if head in FIELDS else forms.GENERAL_ERROR_KEY
            errors[key] = f"{errors[key]}; {err['message']}" if key in errors else err["message"]
        return None, errors


def runs_by_host(runs: list[RunPublic]) -> dict[str, list[RunPublic]]:
    """Each host's runs, active ones first, in the given order within each group."""
    grouped: dict[str, list[RunPublic]] = {}
    for run in sorted(runs, key=lambda r: is_terminal(r.state)):
        grouped.setdefault(run.host, []).append(run)
    return grouped


async def _hosts_page(
    ctl: Controller, request: Request, error: str | None = None, status: int = 200
) -> HTMLResponse:
    runs = runs_by_host(await ctl.list_runs())
    return render(request, "hosts.html", status=status, hosts=await ctl.list_hosts(), runs=runs, error=error)


@router.get("/hosts", response_class=HTMLResponse)
async def hosts(request: Request, ctl: ControllerDep) -> HTMLResponse:
    """Every host: reachability, agent version, scheduler, GPUs and runs."""
    return await _hosts_page(ctl, request)


@post_router.post("/hosts/{name}/remove", response_class=HTMLResponse)
async def remove_host(request: Request, ctl: ControllerDep, name: HostName) -> Response:
    """Forget a host and go back to the list; refused (409: the page, with why) while runs are active."""
    try:
        await ctl.remove_host(name)
    except Conflict as exc:
        reason = f"Not removed: {exc.message}. Stop them or wait until they end, then remove the host."
        return await _hosts_page(ctl, request, error=reason, status=409)
    return RedirectResponse("/hosts", status_code=303)


def _form(
    request: Request, values: dict[str, str], errors: dict[str, str], status: int = 200
) -> HTMLResponse:
    top = errors.get(forms.GENERAL_ERROR_KEY)
    return render(request, "new_host.html", status=status, values=values, errors=errors, general_error=top)


@router.get("/hosts/new", response_class=HTMLResponse)
async def new_host(request: Request) -> HTMLResponse:
    """The empty Add-host form."""
    return _form(request, {"python": "python3", "scheduler": "none", "slurm_gpus": "gpus-per-task"}, {})


@post_router.post("/hosts/new", response_class=HTMLResponse)
async def submit_host(request: Request, ctl: ControllerDep) -> Response:
    """Add the host and go to the Hosts page; on bad input re-show the form with errors, add nothing."""
    form = await request.form()
    values = {k: v for k in FIELDS if isinstance(v := form.get(k), str)}
    host, errors = form_to_host(values)
    if host is not None:
        try:
            await ctl.add_host(host)
        except ControllerError as exc:
            errors = {forms.GENERAL_ERROR_KEY: exc.message}
        else:
            return RedirectResponse("/hosts", status_code=303)
    return _form(request, values, errors, status=422)
