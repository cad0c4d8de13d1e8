"""Backend ``speculators`` as a two-process job through the real daemon, with stand-in scripts.

The stand-ins take the places of a speculators checkout's ``scripts/launch_vllm.py`` (a real HTTP server on
127.0.0.1 answering ``/health``, printing vLLM's readiness lines) and ``scripts/data_generation_offline.py``
(printing speculators' log lines): they start in a second, where the real server needs a minute on CPU. A
stand-in ``vllm.platforms`` (first on the job's PYTHONPATH) answers the job's question which platform vLLM
runs on, so the CUDA route runs here too and no test pays for importing vLLM. The real speculators client
against the real vLLM server, on the real platform, is tests/extract/test_speculators_backend.py.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from agent.extract.engine.runtime import EngineDefaults
from agent.extract.pipelines.plan import API_SERVER, server_defaults, speculators_plan
from agent.extract.pipelines.run import PlatformUnknown, server_platform
from agent.paths import run_paths
from agent.spec import RunSpec, parse_spec
from tests.helpers.agentproc import AgentClient, AgentProc, agent_daemon, terminal_event

__all__ = ["agent_daemon"]

_RECORD = (
    'open(os.environ["STANDIN_DIR"] + "/{}.json", "w").write(json.dumps({{"pid": os.getpid(), '
    '"argv": sys.argv, "env": {{k: os.environ.get(k) for k in ("VLLM_CPU_KVCACHE_SPACE", '
    '"VLLM_WORKER_MULTIPROC_METHOD")}}}}))'
)
_READY = "(APIServer pid=7) INFO 11-30 15:00:00 [api_server.py:1] Starting vLLM API server 0 on http://127.0.0.1:{}"
SERVER = (
    """
import http.server, json, os, sys, time
"""
    + _RECORD.format("server")
    + """
port = int(sys.argv[sys.argv.index("--port") + 1])
if os.environ.get("SERVER_EXIT"):
    print("ValueError: no model here", flush=True)
    sys.exit(int(os.environ["SERVER_EXIT"]))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
def dead(*_):  # vLLM may log its engine's death while it is torn down: not the run's failure
    print("vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.", flush=True)
    sys.exit(0)
import signal
signal.signal(signal.SIGTERM, dead)
srv = http.server.HTTPServer(("127.0.0.1", port), H)
time.sleep(0.5)
print(READY.format(port), flush=True)
print("INFO:     Application startup complete.", flush=True)
srv.serve_forever()
"""
)
#: speculators' client lines as rich and tqdm print them (speculators/cli/generate_offline_data.py)
CLIENT_OUT = [
    "[15:00:01] INFO     EAGLE Offline Data Generation                 generate_offline_data.py:449\n",
    "           INFO     Processing 2 samples                          generate_offline_data.py:288\n",
    "  0%|          | 0/2 [00:00<?, ?it/s]\r"
    " 50%|#####     | 1/2 [00:00<00:00, 3.0it/s, ok=1, err=0, rps=2.0]",
    "[15:00:02] WARNING  Skipping sample 1 due to error: Sequence length of hidden states 3 doesn't match "
    "num tokens 4   generate_offline_data.py:267\n",
]
CLIENT_END = (
    "           INFO     Data generation complete!                     generate_offline_data.py:461\n"
)
CLIENT = (
    """
import json, os, sys, time, urllib.request
urllib.request.urlopen(sys.argv[sys.argv.index("--endpoint") + 1].removesuffix("/v1") + "/health").read()
"""
    + _RECORD.format("client")
    + """
for text in OUT:
    sys.stdout.write(text)
    sys.stdout.flush()
time.sleep(float(os.environ.get("CLIENT_SLEEP", "0")))
sys.stdout.write(END)
"""
)


#: vLLM's platform as the stand-in reports it: STANDIN_PLATFORM, "cuda" unless set
PLATFORMS = """
import os
class _Platform:
    device_type = os.environ.get("STANDIN_PLATFORM", "cuda")
    def is_cpu(self):
        return self.device_type == "cpu"
current_platform = _Platform()
"""


def _scripts(tmp: Path) -> Path:
    scripts = tmp / "scripts"
    scripts.mkdir()
    (tmp / "standin" / "vllm").mkdir(parents=True)
    (tmp / "standin" / "vllm" / "__init__.py").write_text("")
    (tmp / "standin" / "vllm" / "platforms.py").write_text(PLATFORMS)
    (scripts / "launch_vllm.py").write_text(f"READY = {_READY!r}\n" + SERVER)
    (scripts / "data_generation_offline.py").write_text(
        f"OUT = {CLIENT_OUT!r}\nEND = {CLIENT_END!r}\n" + CLIENT
    )
    return scripts


def _model(tmp: Path) -> Path:
    model = tmp / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 8, "hidden_size": 16}))
    return model


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _spec(tmp: Path, env: dict[str, str]) -> dict[str, Any]:
    (tmp / "data").mkdir(exist_ok=True)  # the agent checks it exists; the stand-ins never read it
    return {
        "name": "pair",
        "host": "local",
        "backend": "speculators",
        "model": str(_model(tmp)),
        "dataset": str(tmp / "data"),
        "output_dir": str(tmp / "out"),
        "max_samples": 2,
        "env": {"STANDIN_DIR": str(tmp), "PYTHONPATH": str(tmp / "standin"), **env},
        "speculators": {"scripts_dir": str(_scripts(tmp)), "python": sys.executable, "port": _port(),
                        "ready_timeout_s": 60, "client_args": ["--validate-outputs"]},
    }  # fmt: skip


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _alive(pid)


def _run(c: AgentClient, run: str, spec: dict[str, Any], timeout: float = 60) -> list[dict[str, Any]]:
    c.result("launch", run=run, spec=spec)
    c.result("follow", run=run, after_seq=0)
    got = c.wait_for(lambda m: terminal_event(m) and m["run"] == run, timeout=timeout)
    return [m["event"] for m in got if m.get("type") == "event" and m.get("run") == run]


def _ms(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e.get("type") == "milestone" and e.get("kind") == kind]


def test_server_then_client_tagged_milestones_and_the_server_ended(
    agent_daemon: AgentProc, tmp_path: Path
) -> None:
    spec = _spec(tmp_path, {})
    with AgentClient(agent_daemon.socket) as c:
        events = _run(c, "p1", spec)
    assert events[-1]["state"] == "completed", events[-3:]
    server = json.loads((tmp_path / "server.json").read_text())
    client = json.loads((tmp_path / "client.json").read_text())
    port = str(spec["speculators"]["port"])
    # on CUDA the launcher's own line and connector, and the platform's default in the server's env
    assert server["argv"][1:] == [
        spec["model"], "--hidden-states-path", str(tmp_path / "out" / ".staging-speculators"),
        "--target-layer-ids", "2", "4", "5", "8", "--", "--host", "127.0.0.1", "--port", port,
        "--tensor-parallel-size", "1",
    ]  # fmt: skip
    assert server["env"] == {"VLLM_CPU_KVCACHE_SPACE": None, "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    (config,) = [m for m in _ms(events, "engine_config") if m["fields"].get("source") == "eaglewatch"]
    assert config["fields"]["platform"] == "cuda" and config["fields"]["process"] == "server"
    assert config["fields"]["defaults"] == {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    assert client["argv"][1:] == [
        "--endpoint", f"http://127.0.0.1:{port}/v1", "--preprocessed-data", spec["dataset"],
        "--output", spec["output_dir"], "--max-samples", "2", "--validate-outputs",
    ]  # fmt: skip
    assert _gone(server["pid"])  # the job ends its server once the client is done
    run_dir = run_paths(agent_daemon.state_dir, "p1").dir
    assert "EngineDeadError" in (run_dir / "server-teardown.log").read_text()
    assert "EngineDeadError" not in (run_dir / "output.log").read_text()
    assert not _ms(events, "error")
    ready = _ms(events, "server_ready")
    assert [m["fields"]["process"] for m in ready] == ["server", "server"]
    client_ms = [m for m in events if m.get("type") == "milestone" and m["fields"].get("process") == "client"]
    # tqdm's last redraw has no newline: the record printed after it shares its line, and that record wins
    assert [m["kind"] for m in client_ms] == ["engine_config", "progress", "shape_check_failed", "completed"]
    assert max(m["seq"] for m in ready) < client_ms[0]["seq"]
    bad = client_ms[2]["fields"]
    assert bad["code"] == "seq_len_mismatch" and bad["sample"] == 1 and bad["validator"] == "speculators"
    assert client_ms[1]["fields"]["samples_total"] == 2


def test_stop_ends_server_and_client(agent_daemon: AgentProc, tmp_path: Path) -> None:
    spec = _spec(tmp_path, {"CLIENT_SLEEP": "300"})
    with AgentClient(agent_daemon.socket) as c:
        c.result("launch", run="p2", spec=spec)
        deadline = time.monotonic() + 30
        while not (tmp_path / "client.json").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        server = json.loads((tmp_path / "server.json").read_text())["pid"]
        client = json.loads((tmp_path / "client.json").read_text())["pid"]
        result = c.result("stop", run="p2")
        assert result["confirmed"] is True
        c.result("follow", run="p2", after_seq=0)
        got = c.wait_for(lambda m: terminal_event(m) and m["run"] == "p2", timeout=30)
    assert got[-1]["event"]["state"] == "stopped"
    assert _gone(server) and _gone(client)


def test_a_server_that_exits_before_ready_fails_the_job_and_no_client_starts(
    agent_daemon: AgentProc, tmp_path: Path
) -> None:
    with AgentClient(agent_daemon.socket) as c:
        events = _run(c, "p3", _spec(tmp_path, {"SERVER_EXIT": "3", "STANDIN_PLATFORM": "cpu"}))
    assert events[-1]["state"] == "failed"
    # on CPU the server got the CPU defaults and, after the launcher's stock connector, eaglewatch's (the
    # later --kv_transfer_config wins)
    server = json.loads((tmp_path / "server.json").read_text())
    staging = str(tmp_path / "out" / ".staging-speculators")
    rest = server["argv"][server["argv"].index("--tensor-parallel-size") + 2 :]
    assert "--enforce-eager" in rest and server["env"]["VLLM_CPU_KVCACHE_SPACE"] is not None
    transfer = json.loads(rest[rest.index("--kv_transfer_config") + 1])
    assert transfer["kv_connector"] == "EagleWatchHiddenStatesConnector"
    assert transfer["kv_connector_extra_config"] == {"shared_storage_path": staging}
    (config,) = [m for m in _ms(events, "engine_config") if m["fields"].get("source") == "eaglewatch"]
    assert config["fields"]["platform"] == "cpu"
    assert config["fields"]["defaults"]["VLLM_CPU_KVCACHE_SPACE"] == server["env"]["VLLM_CPU_KVCACHE_SPACE"]
    (failed,) = _ms(events, "failed")
    assert failed["fields"]["reason"] == "the server exited with status 3 before it was ready"
    assert failed["fields"]["process"] == "server"
    assert not (tmp_path / "client.json").exists()


def _pkg_spec(vllm_args: list[str]) -> RunSpec:
    return parse_spec({
        "host": "h", "backend": "speculators", "model": "/m", "dataset": "/d", "output_dir": "/o",
        "layers": [1, 3, 4, 7], "layer_convention": "output", "tensor_parallel_size": 2,
        "vllm_args": vllm_args, "speculators": {"port": 9000, "client_args": ["--rank", "1"]},
    })  # fmt: skip


def test_installed_package_route_on_cuda_builds_the_api_server_with_vllms_connector() -> None:
    spec = _pkg_spec(["--dtype", "float32"])
    spawn = EngineDefaults(
        {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}, [], {"VLLM_WORKER_MULTIPROC_METHOD": "x"}
    )
    defaults = server_defaults("cuda", spec.vllm_args, spawn)
    plan = speculators_plan(spec, "/py", 8, "/o/.staging-speculators", "cuda", defaults)
    argv = plan.server.argv
    # one command for both vLLM builds (the CPU build has no `vllm` metadata for `vllm serve` to read)
    assert argv[:5] == ["/py", "-m", API_SERVER, "--model", "/m"]
    speculative = json.loads(argv[argv.index("--speculative_config") + 1])
    assert speculative["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5, 8]
    transfer = json.loads(argv[argv.index("--kv_transfer_config") + 1])
    assert transfer == {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": "/o/.staging-speculators"},
    }
    assert argv[-8:] == [
        "--host",
        "127.0.0.1",
        "--port",
        "9000",
        "--tensor-parallel-size",
        "2",
        "--dtype",
        "float32",
    ]
    assert plan.server.env == {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    assert plan.client.argv[:4] == ["/py", "-m", "speculators", "generate-offline-data"]
    assert plan.client.argv[-2:] == ["--rank", "1"] and plan.client.env == {"COLUMNS": "400"}
    assert plan.health_url == "http://127.0.0.1:9000/health"


def test_on_cpu_the_server_gets_the_cpu_defaults_and_eaglewatchs_connector_and_the_user_wins() -> None:
    cpu = EngineDefaults(
        {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}, ["--dtype", "float32"], {}
    )
    spec = _pkg_spec(["--max-model-len", "512"])
    defaults = server_defaults("cpu", spec.vllm_args, cpu)
    plan = speculators_plan(spec, "/py", 8, "/o/.st", "cpu", defaults)
    argv = plan.server.argv
    transfer = json.loads(argv[argv.index("--kv_transfer_config") + 1])
    assert transfer["kv_connector"] == "EagleWatchHiddenStatesConnector"
    assert transfer["kv_connector_module_path"] == "agent.extract.engine.native_connector"
    assert transfer["kv_connector_extra_config"] == {"shared_storage_path": "/o/.st"}
    # the defaults come after the common flags and before the user's, so the user's win
    tp = argv.index("--tensor-parallel-size")
    assert argv[tp:] == [
        "--tensor-parallel-size",
        "2",
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "512",
    ]
    assert plan.server.env == cpu.env
    assert defaults.reasons["kv_connector"].startswith("EagleWatchHiddenStatesConnector")
    # the user's own engine arguments: no eager added, their connector named as theirs (it comes last: wins)
    theirs = ["--no-enforce-eager", "--kv-transfer-config", "{}"]
    mine = server_defaults("cpu", theirs, cpu)
    assert "--enforce-eager" not in mine.args and mine.reasons["kv_connector"].startswith("your")
    argv = speculators_plan(_pkg_spec(theirs), "/py", 8, "/o/.st", "cpu", mine).server.argv
    assert argv[-3:] == theirs


def test_a_program_that_cannot_start_fails_the_job_naming_it(agent_daemon: AgentProc, tmp_path: Path) -> None:
    spec = _spec(tmp_path, {})
    spec["speculators"]["python"] = str(tmp_path / "no-such-python")
    with AgentClient(agent_daemon.socket) as c:
        events = _run(c, "p4", spec)
    assert events[-1]["state"] == "failed"
    (failed,) = _ms(events, "failed")
    assert (
        failed["fields"]["reason"] == f"cannot start {tmp_path / 'no-such-python'}: No such file or directory"
    )


@pytest.mark.slow
def test_real_speculators_client_failure_is_reported_from_its_own_log(
    agent_daemon: AgentProc, tmp_path: Path
) -> None:
    """speculators 0.9.0's real client against the stand-in server, which answers /health but has no /v1."""
    pytest.importorskip("speculators")
    from datasets import Dataset

    Dataset.from_dict({"input_ids": [[1, 2, 3]]}).with_format("torch").save_to_disk(str(tmp_path / "data"))
    spec = _spec(tmp_path, {})
    server = str(tmp_path / "scripts" / "launch_vllm.py")
    spec["speculators"] = {
        **spec["speculators"],
        "scripts_dir": None,
        "server_command": [sys.executable, server],
    }
    with AgentClient(agent_daemon.socket) as c:
        events = _run(c, "p5", spec, timeout=120)
    assert events[-1]["state"] == "failed" and events[-1]["exit"]["code"] == 1
    client = [m for m in events if m.get("type") == "milestone" and m["fields"].get("process") == "client"]
    rules = [(m["kind"], m["fields"].get("rule")) for m in client]
    assert rules[0] == ("engine_config", "speculators_client_start")
    assert ("failed", "speculators_failed") in rules
    (error,) = [m for m in client if m["kind"] == "error"]
    assert error["fields"]["exc_type"].endswith("NotFoundError")  # openai's 404 for /v1/models


def test_the_platform_probe_on_a_python_without_vllm_names_why(tmp_path: Path) -> None:
    """A Python that cannot import vLLM (ours without site-packages): the job fails with this reason."""
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    python.chmod(0o755)
    with pytest.raises(PlatformUnknown) as got:
        server_platform(str(python))
    assert str(got.value).startswith(f"{python} cannot import vLLM to tell its platform (exit 1): ")
    assert str(got.value).endswith("No module named 'vllm'")
