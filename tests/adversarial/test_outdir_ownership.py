"""A run owns its output directory: a run into a directory holding another capture (other layers, another
model, or files nothing describes) is refused before launch with a spec error naming what differs, on the
real stack (API in-process, real controller, real local agent); the job itself refuses it again as a last
guard, and leaves no temp file behind when a write fails or a resume starts."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save_file

from controller.service import Controller
from tests.web.conftest import AgentHost, agent_host, client, csrf_of, ctl  # noqa: F401 (the fixtures)

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
OWNER_FILE = ".eaglewatch-owner.json"  # the ownership record's name: a contract (docs/architecture.md)

LAYERS_A = [2, 4, 5, 8]
LAYERS_B = [1, 3, 6, 7]


def model_dir(root: Path, name: str = "model", hidden: int = 16) -> Path:
    """A model folder with only its config.json: enough for the job's --capture and its preflight refusal."""
    folder = root / name
    folder.mkdir()
    cfg = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8, "hidden_size": hidden}
    (folder / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "float32"}))
    return folder


def _sha(model: Path) -> str:
    return hashlib.sha256((model / "config.json").read_bytes()).hexdigest()


def _captured(
    out: Path,
    layers: list[int],
    model: Path,
    record: str | None = OWNER_FILE,
    prompts: Sequence[list[int]] = ([0, 1, 2], [0, 1, 2]),
) -> None:
    """Real capture files of ``layers`` in ``out``, one per prompt, and what a run that wrote them leaves
    beside them: an ownership record (``record`` = OWNER_FILE), an older version's manifest.json, or nothing
    (None)."""
    out.mkdir(exist_ok=True)
    for idx, ids in enumerate(prompts):
        tensors = {"token_ids": torch.tensor(ids), "hidden_states": torch.zeros(len(ids), len(layers), 16)}
        save_file(tensors, str(out / f"hs_{idx}.safetensors"))
    doc = {
        "layer_convention": "input", "model": str(model), "model_config_sha256": _sha(model),
        "dtype": "float32", "backend": "worker-extension",
    }  # fmt: skip
    if record == OWNER_FILE:
        (out / OWNER_FILE).write_text(json.dumps({"run": "r-earlier", "layers": layers, **doc}))
    elif record is not None:
        (out / record).write_text(json.dumps({"format_version": 1, "layer_ids": layers, **doc}))


def extraction(model: Path, out: Path, layers: list[int] | None, **extra: Any) -> dict[str, Any]:
    # a hidden size no model has: a launched job fails at once in its preflight, before it touches output_dir
    dataset = out.parent / "data.jsonl"
    dataset.touch()
    return {
        "name": "own", "host": "local", "backend": "worker-extension", "model": str(model),
        "dataset": str(dataset), "output_dir": str(out), "layers": layers, "expect": {"hidden_size": 1},
        "vllm_args": ["--dtype", "float32"],  # the files' dtype on any CPU (bf16 ones would pick bfloat16)
        **extra,
    }  # fmt: skip


async def with_host(client: httpx.AsyncClient, agent: AgentHost) -> httpx.AsyncClient:  # noqa: F811
    client.headers["x-csrf-token"] = await csrf_of(client)
    r = await client.post(
        "/api/hosts", json={"name": "local", "ssh": "local", "state_dir": str(agent.state_dir)}
    )
    assert r.status_code == 201, r.text
    return client


def refusal(r: httpx.Response) -> str:
    assert r.status_code == 422, r.text
    body = r.json()
    assert [e["field"] for e in body["errors"]] == ["output_dir"], body
    message: str = body["errors"][0]["message"]
    assert "choose another output_dir" in message
    return message


async def ended(ctl: Controller, run_id: str) -> str:  # noqa: F811
    """Catch the run up from the agent until it has ended (the job fails at once: no dataset)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        await ctl.refresh(["local"])
        state = (await ctl.get_run(run_id)).state
        if state in ("failed", "completed", "stopped", "lost"):
            return str(state)
        await asyncio.sleep(0.1)
    raise AssertionError(f"run {run_id} did not end")


async def test_a_new_run_with_other_layers_is_refused_naming_them(
    ctl: Controller,  # noqa: F811
    client: httpx.AsyncClient,  # noqa: F811
    agent_host: AgentHost,  # noqa: F811
    tmp_path: Path,
) -> None:
    c = await with_host(client, agent_host)
    model, out = model_dir(tmp_path), tmp_path / "out"
    _captured(out, LAYERS_A, model)
    message = refusal(await c.post("/api/runs", json=extraction(model, out, LAYERS_B)))
    assert f"holds a capture of layers {LAYERS_A}; this spec asks for layers {LAYERS_B}" in message
    assert (await c.get("/api/runs")).json() == []  # refused before launch: no run, no job
    assert not list((agent_host.state_dir / "runs").iterdir())
    # the default layer ids of this 8-layer model are [2, 4, 5, 8]: the same capture, resumed only when asked
    message = refusal(await c.post("/api/runs", json=extraction(model, out, None)))
    assert "already holds capture files" in message and "resume: true" in message
    r = await c.post("/api/runs", json=extraction(model, out, None, resume=True))
    assert r.status_code == 201, r.text


async def test_a_capture_of_another_model_is_refused_naming_it(
    ctl: Controller,  # noqa: F811
    client: httpx.AsyncClient,  # noqa: F811
    agent_host: AgentHost,  # noqa: F811
    tmp_path: Path,
) -> None:
    c = await with_host(client, agent_host)
    model, other = model_dir(tmp_path), model_dir(tmp_path, "other", hidden=32)
    out = tmp_path / "out"
    _captured(out, LAYERS_A, model)
    message = refusal(await c.post("/api/runs", json=extraction(other, out, LAYERS_A)))
    assert f"model {model} and model_config_sha256 {_sha(model)}" in message
    assert f"model {other} and model_config_sha256 {_sha(other)}" in message
    message = refusal(
        await c.post("/api/runs", json=extraction(model, out, [1, 2], layer_convention="output"))
    )
    assert f"layers {LAYERS_A} and layer_convention input; this spec asks for layers [1, 2] and " in message
    # the same folder with another config.json is another model too
    (model / "config.json").write_text((other / "config.json").read_text())
    message = refusal(await c.post("/api/runs", json=extraction(model, out, LAYERS_A)))
    assert "model_config_sha256" in message and "model " + str(model) not in message


async def test_files_an_older_version_left_are_reused_only_when_its_manifest_matches(
    ctl: Controller,  # noqa: F811
    client: httpx.AsyncClient,  # noqa: F811
    agent_host: AgentHost,  # noqa: F811
    tmp_path: Path,
) -> None:
    c = await with_host(client, agent_host)
    model = model_dir(tmp_path)
    bare, legacy = tmp_path / "bare", tmp_path / "legacy"
    _captured(bare, LAYERS_A, model, record=None)
    _captured(legacy, LAYERS_A, model, record="manifest.json")
    message = refusal(await c.post("/api/runs", json=extraction(model, bare, LAYERS_A)))
    assert "holds capture files but nothing says what they capture" in message
    message = refusal(await c.post("/api/runs", json=extraction(model, legacy, LAYERS_B, name="legacy")))
    assert f"layers {LAYERS_A}; this spec asks for layers {LAYERS_B}" in message
    r = await c.post("/api/runs", json=extraction(model, legacy, LAYERS_A, resume=True))
    assert r.status_code == 201, r.text


async def test_a_resume_into_a_directory_another_capture_took_is_refused(
    ctl: Controller,  # noqa: F811
    client: httpx.AsyncClient,  # noqa: F811
    agent_host: AgentHost,  # noqa: F811
    tmp_path: Path,
) -> None:
    c = await with_host(client, agent_host)
    model, out = model_dir(tmp_path), tmp_path / "out"
    r = await c.post("/api/runs", json=extraction(model, out, LAYERS_B))
    assert r.status_code == 201, r.text
    first = r.json()["id"]
    assert await ended(ctl, first) == "failed"  # its preflight refuses the spec's expect
    _captured(out, LAYERS_A, model)  # meanwhile another run captured other layers there
    message = refusal(await c.post(f"/api/runs/{first}/resume"))
    assert f"holds a capture of layers {LAYERS_A}; this spec asks for layers {LAYERS_B}" in message
    detail = (await c.get(f"/api/runs/{first}")).json()
    assert detail["resumed_by"] == [] and [r["id"] for r in (await c.get("/api/runs")).json()] == [first]


def _job(spec: dict[str, Any], tmp_path: Path, run: str) -> subprocess.CompletedProcess[str]:
    """The extraction job as the agent starts it, with no daemon in front: its own last guard is tested."""
    path = tmp_path / f"{run}.json"
    path.write_text(json.dumps(spec))
    argv = [sys.executable, "-m", "agent", "extract", "--spec", str(path)]
    env = {**os.environ, "EAGLEWATCH_RUN_ID": run}
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)


def test_the_job_refuses_another_capture_and_a_resume_clears_its_stale_temp_files(tmp_path: Path) -> None:
    model, out, data = model_dir(tmp_path), tmp_path / "out", tmp_path / "data.jsonl"
    prompts = [[1, 2, 3], [4, 5]]
    data.write_text("".join(json.dumps({"token_ids": ids}) + "\n" for ids in prompts))
    _captured(out, LAYERS_A, model, prompts=prompts)
    stale, other = out / ".hs_1.safetensors.4242.17.tmp", out / ".hs_7.safetensors.4242.18.tmp"
    for path in (stale, other):
        path.write_bytes(b"half a file")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    spec = {**extraction(model, out, LAYERS_B), "dataset": str(data), "expect": {}}
    job = _job(spec, tmp_path, "r-other")
    assert job.returncode == 2, job.stdout + job.stderr
    assert f"holds a capture of layers {LAYERS_A}; this spec asks for layers {LAYERS_B}" in job.stdout
    assert "resuming" not in job.stdout and '"kind": "failed"' in job.stdout
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # a refused job touches nothing
    # the same capture resumes: every file is valid (no engine starts), and the temp file a killed writer
    # left for one of its samples is gone; sample 7's is not this job's (a sibling shard may be writing it)
    job = _job({**spec, "layers": None}, tmp_path, "r-resume")
    assert job.returncode == 0, job.stdout + job.stderr
    assert "resuming: 2 of 2 samples already valid" in job.stdout
    assert not stale.exists() and other.exists()
    assert json.loads((out / OWNER_FILE).read_text())["run"] == "r-resume"


FILL = """
import resource, signal, sys, torch
from agent.extract.writing.writer import write_sample
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG, like a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
try:
    write_sample(sys.argv[1], 3, torch.arange(64), torch.zeros(64, 4, 64))
except OSError as exc:
    print(exc.errno)
"""


def test_a_write_that_fails_leaves_no_temp_file(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", FILL, str(tmp_path)], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "27", done.stderr  # EFBIG
    assert sorted(p.name for p in tmp_path.iterdir()) == []
