"""A sharded run whose host path the host refuses leaves nothing behind, as an unsharded one: the API answers
422 naming the field, and no run row (the run, its hidden shard jobs, its shards) is left.  Real stack: API
in-process, real controller, real local agent."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from controller.service import Controller
from tests.adversarial.test_outdir_ownership import extraction, model_dir, with_host
from tests.web.conftest import AgentHost, agent_host, client, csrf_of, ctl  # noqa: F401 (the fixtures)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("field", ["dataset", "model"])
async def test_a_refused_sharded_run_is_forgotten_naming_the_field(
    field: str,
    ctl: Controller,  # noqa: F811
    client: httpx.AsyncClient,  # noqa: F811
    agent_host: AgentHost,  # noqa: F811
    tmp_path: Path,
) -> None:
    c = await with_host(client, agent_host)
    spec = extraction(model_dir(tmp_path), tmp_path / "out", None, shards=2)
    spec[field] = str(tmp_path / "missing")
    r = await c.post("/api/runs", json=spec)
    assert r.status_code == 422, r.text
    errors = r.json()["errors"]
    assert [e["field"] for e in errors] == [field] and "does not exist on this host" in errors[0]["message"]
    assert (await c.get("/api/runs")).json() == []
    left = await ctl.store.read(
        lambda conn: [
            conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0] for table in ("runs", "run_shards")
        ]
    )
    assert left == [0, 0]
