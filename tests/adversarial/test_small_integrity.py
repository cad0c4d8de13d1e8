"""Small integrity holes: values pass verbatim, a user's argv is never rewritten, a full agent home is named,
secrets stay hidden, names are matched whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from agent.checks.dirs import SHARD_MANIFEST, family, is_capture_file
from agent.extract.planning.preflight import load_spec
from agent.milestones.rulefile import RuleError, validate_rule
from agent.paths import run_paths, valid_run_id
from agent.runs.capture_checks import GROUP_DIR
from agent.spec import Shard, parse_spec
from controller.alerts import AlertPolicy
from controller.crud import insert_run, transition
from controller.errors import SpecInvalid
from controller.lifecycle import RunEvent
from controller.models import HostCreate, parse_run_spec
from controller.service import Controller
from controller.store import Tx
from tests.helpers.agentproc import AgentClient, AgentError, cleanup_runs, start_agent, terminal_event
from tests.web.conftest import client, ctl, wait_until  # noqa: F401 (the fixtures)
from web.filters import is_secret_name
from web.run_templates import TemplateError, TemplateStore

CMD = {"host": "h1", "backend": "command", "command": ["/bin/echo"]}
EXTRACT = {
    "host": "h1",
    "backend": "worker-extension",
    "model": "/m",
    "dataset": "/d.jsonl",
    "output_dir": "/o",
}


# --- values pass verbatim, identifiers are checked whole -------------------------------------------------
def test_argv_and_env_values_pass_verbatim() -> None:
    argv = ["/bin/echo", "  padded  ", "\ttab", "trailing\n", ""]
    env = {"V": "  spaced  ", "NL": "x\n", "EMPTY": ""}
    for parse in (parse_spec, parse_run_spec):
        spec = parse({**CMD, "command": argv, "env": env})
        assert spec.command == argv and spec.env == env
        ext = parse({**EXTRACT, "vllm_args": ["--served-model-name", " padded "]})
        assert ext.vllm_args == ["--served-model-name", " padded "]
    pipeline = parse_spec(
        {**EXTRACT, "backend": "speculators", "speculators": {"client_args": ["--rank", " 0 "]}}
    )
    assert pipeline.speculators is not None and pipeline.speculators.client_args == ["--rank", " 0 "]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("env", {"A\n": "1"}),
        ("env", {" A": "1"}),
        ("name", "run\n"),
        ("name", " run"),
        ("host", "h1\n"),
        ("host", ["h1", "h2 "]),
    ],
)
def test_identifiers_are_validated_whole_with_an_error_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(SpecInvalid) as exc:
        parse_run_spec({**CMD, field: value})
    assert [e["field"] for e in exc.value.errors] == [field]


def test_host_names_are_whole_and_ssh_destinations_trimmed() -> None:
    with pytest.raises(ValidationError):
        HostCreate(name="h1\n", ssh="h1")
    assert HostCreate(name="h1", ssh="  user@h1  ").ssh == "user@h1"
    assert HostCreate(name="h1", ssh="h1", scheduler="slurm", sbatch_args=["--comment=a b "]).sbatch_args == [
        "--comment=a b "
    ]


# --- an array task never rewrites the user's argv ---------------------------------------------------------
def _task(run_dir: Path, argv: list[str], task: int, shards: int) -> subprocess.CompletedProcess[str]:
    (run_dir / "launch.json").write_text(json.dumps({"argv": argv, "env": {}, "shards": shards}))
    env = {**os.environ, "SLURM_ARRAY_TASK_ID": str(task)}
    return subprocess.run(
        [sys.executable, "-m", "agent.sched.task", str(run_dir)], env=env, capture_output=True, text=True
    )


@pytest.mark.parametrize("tail", [["--spec"], ["--spec", "/nonexistent/mine.json"], ["--spec", "{}"]])
def test_an_array_task_runs_the_users_argv_untouched(tmp_path: Path, tail: list[str]) -> None:
    run_dir = tmp_path / "r1"
    run_dir.mkdir()
    show = "import json, os, sys; print(json.dumps([sys.argv[1:], os.environ['EAGLEWATCH_SHARD']]))"
    out = _task(run_dir, [sys.executable, "-c", show, *tail], task=1, shards=2)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [tail, "1/2"]
    assert sorted(p.name for p in run_dir.iterdir()) == ["launch.json"]


def test_an_extraction_task_takes_its_shard_from_the_agent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(EXTRACT))
    assert load_spec(str(path)).shard is None
    monkeypatch.setenv("EAGLEWATCH_SHARD", "1/3")
    assert load_spec(str(path)).shard == Shard(index=1, count=3)
    with pytest.raises(SpecInvalid) as exc:  # the agent's own variable, not a user's
        parse_run_spec({**EXTRACT, "env": {"EAGLEWATCH_SHARD": "0/2"}})
    assert [e["field"] for e in exc.value.errors] == ["env"]


# --- a full agent home is named as the reason -------------------------------------------------------------
@pytest.fixture
def full_home(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs as the agent's home (needs root or CAP_SYS_ADMIN)."""
    mnt = tmp_path / "home"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.slow
def test_a_full_agent_home_ends_the_run_naming_enospc(full_home: Path, tmp_path: Path) -> None:
    state = full_home / "state"
    filler = tmp_path / "fill.py"
    filler.write_text(  # once the daemon has journaled the launch, fill the device and exit 3
        "import pathlib, sys, time\n"
        "while b'running' not in pathlib.Path('events.jsonl').read_bytes():\n"
        "    time.sleep(0.01)\n"
        "with open('filler', 'wb') as f:\n"
        "    try:\n"
        "        while True:\n"
        "            f.write(b'x' * 65536)\n"
        "            f.flush()\n"
        "    except OSError:\n"
        "        sys.exit(3)\n"
    )
    agent = start_agent(state, socket_path=tmp_path / "a.sock")
    try:
        with AgentClient(agent.socket) as c:
            c.result(
                "launch", run="full", spec={"backend": "command", "command": [sys.executable, str(filler)]}
            )
            c.result("follow", run="full", after_seq=0)
            last = c.wait_for(terminal_event, timeout=60)[-1]["event"]
            run_dir = state / "runs" / "full"
            assert last["state"] == "failed", last
            assert f"no space left on device in {run_dir}" in last["reason"]
            assert "exit code 3" in last["reason"]
            # the watcher writes its last cursor after the final state goes out: wait for that write
            left = lambda: not any(p.name.endswith(".tmp") for p in run_dir.iterdir())  # noqa: E731
            wait_until(left, 10, what="no temporary file left")
            with pytest.raises(AgentError) as refused:  # still full: a new run is refused, saying why
                c.result("launch", run="next", spec={"backend": "command", "command": ["/bin/true"]})
            assert f"no space left on device in {state / 'runs' / 'next'}" in str(refused.value)
    finally:
        agent.kill()
        cleanup_runs(state)


# --- secrets hidden by default ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("DB_PASS", True), ("PRIVATE_PEM", True), ("HF_TOKEN", True), ("AWS_SECRET_ACCESS_KEY", True),
        ("GCP_CREDENTIALS", True), ("MYSQL_PASSWORD", True), ("db_passphrase", True),
        ("LOG_LEVEL", False), ("CUDA_VISIBLE_DEVICES", False),
    ],
)  # fmt: skip
def test_secret_names(name: str, secret: bool) -> None:
    assert is_secret_name(name) is secret


SECRETS = {"DB_PASS": "pw-value-0123", "PRIVATE_PEM": "-----BEGIN PRIVATE KEY-----abc"}


def _seed_run(tx: Tx) -> None:
    quiet = AlertPolicy(cooldown_s=0, deliver=False)
    tx.conn.execute(
        "INSERT INTO hosts(name, ssh, python, created_at, gpus_json) VALUES ('h1','h1','python3',0,'[]')"
    )
    spec = {**CMD, "env": {**SECRETS, "LOG_LEVEL": "debug"}}
    insert_run(
        tx=tx, run_id="r-1", name="run", host="h1", backend="command", model=None, spec_json=json.dumps(spec)
    )
    transition(tx=tx, run_id="r-1", event=RunEvent.LAUNCH, policy=quiet)


async def test_secret_env_values_stay_off_the_api_the_run_page_and_the_run_again_form(
    ctl: Controller,  # noqa: F811
    client: httpx.AsyncClient,  # noqa: F811
) -> None:
    await ctl.store.write(_seed_run)
    for path, shown in [
        ("/api/runs/r-1", '"LOG_LEVEL":"debug"'),
        ("/runs/r-1", "debug"),
        ("/runs/new?again=r-1", "LOG_LEVEL=debug"),
    ]:
        r = await client.get(path)
        assert r.status_code == 200 and shown in r.text, path
        for value in SECRETS.values():
            assert value not in r.text, path
    form = (await client.get("/runs/new?again=r-1")).text
    assert "DB_PASS=" in form and "PRIVATE_PEM=" in form


# --- names matched whole ----------------------------------------------------------------------------------
def test_names_with_a_trailing_newline_are_refused(tmp_path: Path) -> None:
    assert not valid_run_id("x\n") and valid_run_id("x")
    with pytest.raises(ValueError):
        run_paths(tmp_path, "x\n")
    with pytest.raises(RuleError):
        validate_rule({"name": "mine\n", "kind": "warning", "regex": "x"}, "spec.rules", 0, user=True)
    assert not is_capture_file("hs_1.safetensors\n") and family("hs_1.safetensors\n") is None
    assert family("hs_1.safetensors") == ("hs_{}.safetensors", 1)
    assert SHARD_MANIFEST.match("manifest.shard-0-of-2.json\n") is None
    assert GROUP_DIR.match("rows_0-2000\n") is None and GROUP_DIR.match("rows_0-2000")
    with pytest.raises(TemplateError):
        TemplateStore(tmp_path).save("mine\n", {"host": "h1"})
    TemplateStore(tmp_path).save("mine", {"host": "h1"})
    assert TemplateStore(tmp_path).names() == ["mine"]
