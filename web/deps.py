"""FastAPI dependencies (Annotated aliases): the controller, the session, CSRF enforcement, templates."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Request

from controller.service import Controller
from web import security
from web.run_templates import TemplateStore


def get_controller(request: Request) -> Controller:
    """The Controller facade this app serves."""
    controller: Controller = request.app.state.controller
    return controller


def get_session(request: Request) -> security.Session:
    """The session the middleware attached to this request."""
    session: security.Session = request.state.session
    return session


def get_csrf_token(request: Request) -> str:
    """The CSRF token pages embed in forms and in ``<meta name="csrf-token">``."""
    signer: security.Signer = request.app.state.signer
    return signer.csrf_token(get_session(request))


async def require_csrf(request: Request) -> None:
    """Refuse a state-changing request without this session's CSRF token (header or form field)."""
    if request.state.bearer:
        return  # Authorization headers are never added by a browser on its own: no CSRF risk
    signer: security.Signer = request.app.state.signer
    token = request.headers.get(security.CSRF_HEADER)
    ctype = request.headers.get("content-type", "")
    if token is None and ctype.startswith(("application/x-www-form-urlencoded", "multipart/form-data")):
        form = await request.form()
        value = form.get(security.CSRF_FIELD)
        token = value if isinstance(value, str) else None
    if not signer.check_csrf(get_session(request), token):
        raise HTTPException(status_code=403, detail="missing or wrong CSRF token (reload the page and retry)")


def get_template_store(request: Request) -> TemplateStore:
    """Saved run templates under EAGLEWATCH_HOME."""
    store: TemplateStore = request.app.state.template_store
    return store


ControllerDep = Annotated[Controller, Depends(get_controller)]
SessionDep = Annotated[security.Session, Depends(get_session)]
CsrfTokenDep = Annotated[str, Depends(get_csrf_token)]
TemplateStoreDep = Annotated[TemplateStore, Depends(get_template_store)]
CSRF_REQUIRED = [Depends(require_csrf)]
