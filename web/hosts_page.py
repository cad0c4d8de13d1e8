"""The Add-host page: an SSH host, or a Slurm login node whose runs are submitted with sbatch."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from pydantic import ValidationError

from controller.errors import ControllerError
from controller.models import HostCreate
from web import forms
from web.deps import CSRF_REQUIRED, ControllerDep
from web.pages import render

router = APIRouter(include_in_schema=False)
post_router = APIRouter(include_in_schema=False, dependencies=CSRF_REQUIRED)
#: Form fields; ``sbatch_args`` holds one option a line.
FIELDS = ("name", "ssh", "python", "scheduler", "partition", "account", "sbatch_args", "slurm_gpus")


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


def _page(
    request: Request, values: dict[str, str], errors: dict[str, str], status: int = 200
) -> HTMLResponse:
    return render(
        request,
        "new_host.html",
        status=status,
        values=values,
        errors=errors,
        general_error=errors.get(forms.GENERAL_ERROR_KEY),
    )


@router.get("/hosts/new", response_class=HTMLResponse)
async def new_host(request: Request) -> HTMLResponse:
    """The empty Add-host form."""
    return _page(request, {"python": "python3", "scheduler": "none", "slurm_gpus": "gpus-per-task"}, {})


@post_router.post("/hosts/new", response_class=HTMLResponse)
async def submit_host(request: Request, ctl: ControllerDep) -> Response:
    """Add the host and go to the dashboard; on bad input re-show the form with errors, add nothing."""
    form = await request.form()
    values = {k: v for k in FIELDS if isinstance(v := form.get(k), str)}
    host, errors = form_to_host(values)
    if host is not None:
        try:
            await ctl.add_host(host)
        except ControllerError as exc:
            errors = {forms.GENERAL_ERROR_KEY: exc.message}
        else:
            return RedirectResponse("/", status_code=303)
    return _page(request, values, errors, status=422)
