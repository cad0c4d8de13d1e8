"""Secrets at rest: private home and database, templates without secret values, pages never echo them."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from controller.models import HostCreate
from controller.service import Controller
from tests.web.conftest import csrf_of, settings_for
from web.run_templates import FILE_NAME

SECRET = "hf_SuperSecretValue123"


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def loose_umask() -> Iterator[None]:
    """The usual 022 umask, under which files are created world-readable unless the code says otherwise."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.usefixtures("loose_umask")
async def test_home_is_0700_and_database_0600(tmp_path: Path) -> None:
    old_home = tmp_path / "old"
    old_home.mkdir(mode=0o755)  # made by an earlier version
    for home in (tmp_path / "new" / "home", old_home):
        c = Controller(settings_for(home), supervise=False)
        await c.start()
        try:
            await c.add_host(HostCreate(name="h1", ssh="h1"))
            db = c.settings.database
            assert _mode(home) == 0o700, home
            assert _mode(db) == 0o600
            wal = db.with_name(db.name + "-wal")
            assert not wal.exists() or _mode(wal) == 0o600
        finally:
            await c.stop()


async def test_templates_keep_no_secret_values(ctl: Controller, client: httpx.AsyncClient) -> None:
    form = {
        "csrf_token": await csrf_of(client), "action": "save_template", "template_name": "with env",
        "host": "h1", "backend": "command", "command": "true",
        "env": f"HF_TOKEN={SECRET}\nWANDB_API_KEY={SECRET}x\nLOG_LEVEL=debug",
    }  # fmt: skip
    r = await client.post("/runs/new", data=form)
    assert r.status_code == 200 and "saved" in r.text
    assert SECRET not in r.text  # the page that confirms the save does not echo it either
    path = ctl.settings.home / FILE_NAME
    assert SECRET not in path.read_text() and "LOG_LEVEL=debug" in path.read_text()
    assert _mode(path) == 0o600
    page = (await client.get("/runs/new", params={"template": "with env"})).text
    assert SECRET not in page and "HF_TOKEN=" in page and "LOG_LEVEL=debug" in page


async def test_template_saved_by_an_older_version_is_not_shown_with_its_secret(
    ctl: Controller, client: httpx.AsyncClient
) -> None:
    path = ctl.settings.home / FILE_NAME
    path.write_text(json.dumps({"old": {"host": "h1", "env": f"HF_TOKEN={SECRET}"}}))
    path.chmod(0o644)
    page = (await client.get("/runs/new", params={"template": "old"})).text
    assert SECRET not in page and "HF_TOKEN=" in page


async def test_form_errors_do_not_echo_secrets_and_empty_secret_is_refused(
    ctl: Controller, client: httpx.AsyncClient
) -> None:
    tok = await csrf_of(client)
    base = {"csrf_token": tok, "host": "h1", "backend": "command", "command": "true"}
    r = await client.post("/runs/new", data={**base, "max_samples": "many", "env": f"HF_TOKEN={SECRET}"})
    assert r.status_code == 422 and "whole number" in r.text
    assert SECRET not in r.text
    r = await client.post("/runs/new", data={**base, "env": "HF_TOKEN="})
    assert r.status_code == 422 and "HF_TOKEN has no value" in r.text
    assert await ctl.list_runs() == []
