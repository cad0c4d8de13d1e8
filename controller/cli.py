"""``eaglewatch``: the controller command line (typer + rich); talks to the store and agents directly.

Each command runs a short-lived Controller on the shared SQLite database.  ``runs start``/``stop`` open a
one-shot link to the host's agent (a running ``serve`` picks the new run up from the database and follows
it too; journal seq dedupe keeps both safe).  ``runs logs -f`` supervises just that run's host while it
prints.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.table import Column, Table
from rich.text import Text

import agent
from controller.errors import ControllerError, HostKeyRejected, SpecInvalid, Unreachable
from controller.lifecycle import is_terminal
from controller.models import HostCreate
from controller.settings import Settings

T = TypeVar("T")
app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="Launch and watch hidden-state extraction runs."
)
hosts_app = typer.Typer(no_args_is_help=True, help="GPU hosts reached over SSH.")
runs_app = typer.Typer(no_args_is_help=True, help="Extraction runs.")
alerts_app = typer.Typer(no_args_is_help=True, help="Alerts.")
app.add_typer(hosts_app, name="hosts")
app.add_typer(runs_app, name="runs")
app.add_typer(alerts_app, name="alerts")
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)
STATE_STYLE = {
    "running": "cyan",
    "completed": "green",
    "failed": "red",
    "stopped": "yellow",
    "lost": "red",
    "unknown": "magenta",
    "pending": "dim",
    "starting": "blue",
}
MILESTONE_STYLE = {
    "error": "bold red",
    "failed": "bold red",
    "shape_check_failed": "bold red",
    "warning": "yellow",
    "completed": "bold green",
    "shape_check_passed": "green",
}


def _controller(**kwargs: Any) -> Any:
    from controller.service import Controller

    return Controller(Settings(), **kwargs)


def _run(fn: Callable[[Any], Awaitable[T]], **kwargs: Any) -> T:
    """Run ``fn(controller)`` in a short-lived controller; typed errors become a message and exit code."""

    async def main() -> T:
        async with _controller(**{"supervise": False, **kwargs}) as ctl:
            return await fn(ctl)

    try:
        return asyncio.run(main())
    except SpecInvalid as exc:
        _invalid(exc)
    except ControllerError as exc:
        err.print(Text(f"error: {exc.message}", style="red"))
        raise typer.Exit(1) from None


def _invalid(exc: SpecInvalid) -> NoReturn:
    """Print each field error and exit 2 (bad input)."""
    for e in exc.errors:
        err.print(Text(f"error: {e['field']}: {e['message']}", style="red"))
    raise typer.Exit(2)


def _json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def _version(value: bool) -> None:
    if value:
        out.print(f"eaglewatch {agent.__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show version.")
    ] = False,
) -> None:
    """eaglewatch controller."""


# ----------------------------------------------------------------------------------------------- hosts


@hosts_app.command("add")
def hosts_add(
    name: str,
    ssh: Annotated[str, typer.Option("--ssh", help="SSH destination: ~/.ssh/config alias or [user@]host")],
    python: Annotated[
        str, typer.Option("--python", help="the host's Python (the one with vLLM)")
    ] = "python3",
    state_dir: Annotated[str | None, typer.Option("--state-dir", hidden=True)] = None,
) -> None:
    """Add a host; shows its SSH key fingerprint and connects only if known_hosts trusts it."""
    from pydantic import ValidationError

    from controller.runs import validation_errors

    try:
        spec = HostCreate(name=name, ssh=ssh, python=python, state_dir=state_dir)
    except ValidationError as exc:
        _invalid(SpecInvalid(validation_errors(exc)))

    async def go(ctl: Any) -> None:
        if ssh != "local":
            try:
                fp = await ctl.supervisors.fetch_fingerprint(ssh)
                out.print(f"host key of {ssh}: [bold]{fp}[/]")
            except Unreachable as exc:
                err.print(Text(f"warning: {exc.message}", style="yellow"))
        await ctl.add_host(spec)
        out.print(f"added host [bold]{name}[/]")
        try:
            host = await ctl.check_host(name)
        except HostKeyRejected as exc:
            err.print(Text(f"not connected: {exc.message}", style="yellow"))
            err.print(
                "known_hosts does not trust this key: check the fingerprint above with the host's owner, "
                f"add it (e.g. `ssh {ssh}` once and accept it), then run `eaglewatch hosts check {name}`."
            )
            return
        except Unreachable as exc:
            err.print(Text(f"not connected: {exc.message}", style="yellow"))
            return
        out.print(f"connected: agent {host.agent_version}, {len(host.gpus)} GPU(s)")

    _run(go)


@hosts_app.command("ls")
def hosts_ls(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """List hosts."""
    hosts = _run(lambda ctl: ctl.list_hosts())
    if as_json:
        _json([h.model_dump(mode="json") for h in hosts])
        return
    table = Table("name", "ssh", "python", "reachable", "agent", "GPUs", "fingerprint")
    for h in hosts:
        reach = {True: "[green]yes[/]", False: "[red]no[/]", None: "?"}[h.reachable]
        table.add_row(
            Text(h.name),
            Text(h.ssh),
            Text(h.python),
            reach,
            Text(h.agent_version or "-"),
            str(len(h.gpus)),
            Text(h.fingerprint or "-"),
        )
    out.print(table)


@hosts_app.command("check")
def hosts_check(name: str) -> None:
    """Connect to a host now (bootstrapping the agent) and show its GPUs."""
    host = _run(lambda ctl: ctl.check_host(name))
    out.print(f"{host.name}: reachable, agent {host.agent_version}, key {host.fingerprint or '-'}")
    for g in host.gpus:
        out.print(
            Text(
                f"  GPU {g.get('index')}: {g.get('name')} {g.get('memory_used_mib')}/"
                f"{g.get('memory_total_mib')} MiB"
            )
        )


@hosts_app.command("rm")
def hosts_rm(name: str) -> None:
    """Remove a host."""
    _run(lambda ctl: ctl.remove_host(name))
    out.print(f"removed host {name}")


# ----------------------------------------------------------------------------------------------- runs


def _split_ints(text: str | None, what: str) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SpecInvalid(
            [{"field": what, "message": f"expected comma-separated integers, got {text!r}"}]
        ) from None


@runs_app.command("start", context_settings={"allow_interspersed_args": False})
def runs_start(
    host: Annotated[str, typer.Option("--host", help="host name")],
    command: Annotated[list[str] | None, typer.Argument(help="after --: a command to run and watch")] = None,
    spec_file: Annotated[Path | None, typer.Option("--spec", help="run spec JSON (or TOML) file")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    name: Annotated[str | None, typer.Option("--name")] = None,
    backend: Annotated[
        str | None, typer.Option("--backend", help="worker-extension | vllm-native | command")
    ] = None,
    model: Annotated[str | None, typer.Option("--model")] = None,
    dataset: Annotated[str | None, typer.Option("--dataset")] = None,
    output_dir: Annotated[str | None, typer.Option("--output-dir")] = None,
    layers: Annotated[str | None, typer.Option("--layers", help="comma-separated layer ids")] = None,
    layer_convention: Annotated[str | None, typer.Option("--layer-convention")] = None,
    tp: Annotated[int | None, typer.Option("--tensor-parallel-size", "--tp")] = None,
    max_samples: Annotated[int | None, typer.Option("--max-samples")] = None,
    seq_len: Annotated[int | None, typer.Option("--seq-len")] = None,
    batch_size: Annotated[int | None, typer.Option("--batch-size")] = None,
    env: Annotated[list[str] | None, typer.Option("--env", help="KEY=VALUE (repeatable)")] = None,
    vllm_arg: Annotated[
        list[str] | None, typer.Option("--vllm-arg", help="extra engine argument (repeatable)")
    ] = None,
    expect_layers: Annotated[int | None, typer.Option("--expect-layers")] = None,
    expect_hidden_size: Annotated[int | None, typer.Option("--expect-hidden-size")] = None,
    on_shape_failure: Annotated[str | None, typer.Option("--on-shape-failure", help="alert | stop")] = None,
) -> None:
    """Start a run; prints its id ({"id": …} with --json)."""
    spec: dict[str, Any] = {}
    if spec_file is not None:
        try:
            text = spec_file.read_text()
            if spec_file.suffix == ".toml":
                import tomllib

                spec = tomllib.loads(text)
            else:
                spec = json.loads(text)
        except (OSError, ValueError) as exc:
            err.print(Text(f"error: cannot read spec {spec_file}: {exc}", style="red"))
            raise typer.Exit(2) from None
        if not isinstance(spec, dict):
            err.print(Text(f"error: spec {spec_file} must hold an object", style="red"))
            raise typer.Exit(2)
    try:
        opts = {
            "name": name,
            "backend": backend,
            "model": model,
            "dataset": dataset,
            "output_dir": output_dir,
            "layers": _split_ints(layers, "layers"),
            "layer_convention": layer_convention,
            "tensor_parallel_size": tp,
            "max_samples": max_samples,
            "seq_len": seq_len,
            "batch_size": batch_size,
            "vllm_args": vllm_arg or None,
            "on_shape_failure": on_shape_failure,
        }
        spec.update({k: v for k, v in opts.items() if v is not None})
        if env:
            bad = [e for e in env if "=" not in e]
            if bad:
                raise SpecInvalid([{"field": "env", "message": f"expected KEY=VALUE, got {bad[0]!r}"}])
            spec["env"] = {**spec.get("env", {}), **dict(e.split("=", 1) for e in env)}
        if expect_layers is not None or expect_hidden_size is not None:
            spec["expect"] = {
                **spec.get("expect", {}),
                **{
                    k: v
                    for k, v in (("layers", expect_layers), ("hidden_size", expect_hidden_size))
                    if v is not None
                },
            }
    except SpecInvalid as exc:
        _invalid(exc)
    spec["host"] = host
    if command:
        spec["command"] = list(command)
        spec.setdefault("backend", "command")

    async def go(ctl: Any) -> Any:
        run_id = await ctl.create_run(spec)
        return await ctl.get_run(run_id)

    run = _run(go)
    if as_json:
        _json({"id": run.id})
    else:
        out.print(run.id)
    if run.state == "failed":
        err.print(Text(f"run {run.id} failed: {run.failure_reason}", style="red"))
        raise typer.Exit(1)


@runs_app.command("ls")
def runs_ls(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """List runs, newest first."""
    runs = _run(lambda ctl: ctl.list_runs())
    if as_json:
        _json([r.model_dump(mode="json") for r in runs])
        return
    table = Table("name", "host", "backend", "state", "last milestone", "progress", "alerts")
    table.columns.insert(0, Column("id", no_wrap=True, min_width=22))
    for r in runs:
        prog = r.progress or {}
        progress = f"{prog.get('samples_done')}/{prog.get('samples_total')}" if "samples_done" in prog else ""
        table.add_row(
            Text(r.id),
            Text(r.name),
            Text(r.host),
            Text(r.backend),
            Text(r.state, style=STATE_STYLE.get(r.state, "")),
            Text(r.last_milestone or ""),
            Text(progress),
            str(r.open_alerts or ""),
        )
    out.print(table)


@runs_app.command("show")
def runs_show(
    run_id: Annotated[str, typer.Argument(metavar="RUN")],
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Show a run (same shape as GET /api/runs/{id} with --json)."""
    run = _run(lambda ctl: ctl.get_run(run_id))
    if as_json:
        _json(run.model_dump(mode="json"))
        return
    out.print(Text.assemble((run.id, "bold"), "  ", (run.state, STATE_STYLE.get(run.state, ""))))
    for label, value in (
        ("name", run.name),
        ("host", run.host),
        ("backend", run.backend),
        ("model", run.model),
        ("exit", run.exit),
        ("failure", run.failure_reason),
        ("progress", run.progress),
    ):
        if value is not None:
            out.print(Text(f"  {label}: {value}"))
    for m in run.milestones:
        out.print(Text.assemble("  ", (f"{m.kind:<22}", MILESTONE_STYLE.get(m.kind, "cyan")), m.text[:160]))
    for p in run.problems:
        out.print(Text(f"  problem {p.code}: {p.file}: {p.message}", style="red"))
    for a in run.alerts:
        out.print(Text(f"  alert [{a.severity}] {a.rule}: {a.message}", style="yellow"))


@runs_app.command("stop")
def runs_stop(run_id: Annotated[str, typer.Argument(metavar="RUN")]) -> None:
    """Stop a run through its host's agent."""
    run = _run(lambda ctl: ctl.stop_run(run_id))
    out.print(Text(f"{run.id}: {run.state}"))


def _print_line(text: str, milestone_texts: set[str]) -> None:
    out.print(Text(text, style="bold magenta" if text in milestone_texts else ""))


@runs_app.command("logs")
def runs_logs(
    run_id: Annotated[str, typer.Argument(metavar="RUN")],
    follow: Annotated[bool, typer.Option("-f", "--follow", help="keep printing new lines")] = False,
) -> None:
    """Print a run's log (milestone lines highlighted); -f follows it live like tail -f."""

    async def dump(ctl: Any) -> None:
        run = await ctl.get_run(run_id)
        marks = {m.text for m in run.milestones}
        offset = -1
        while True:
            lines = await ctl.read_log(run_id, after_offset=offset, limit=5000)
            for line in lines:
                _print_line(line["text"], marks)
            if not lines:
                return
            offset = lines[-1]["offset"]

    if not follow:
        _run(dump)
        return
    host = _run(lambda ctl: ctl.get_run(run_id)).host

    async def tail(ctl: Any) -> None:
        run = await ctl.get_run(run_id)
        marks = {m.text for m in run.milestones}
        offset, quiet = -1, 0
        while True:
            lines = await ctl.read_log(run_id, after_offset=offset, limit=5000)
            if lines:
                run = await ctl.get_run(run_id)
                marks = {m.text for m in run.milestones}
            for line in lines:
                _print_line(line["text"], marks)
            if lines:
                offset, quiet = lines[-1]["offset"], 0
                continue
            run = await ctl.get_run(run_id)
            quiet = quiet + 1 if is_terminal(run.state) else 0
            if quiet > 5:
                err.print(Text(f"-- run {run.id} {run.state}", style=STATE_STYLE.get(run.state, "")))
                return
            await asyncio.sleep(0.2)

    try:
        _run(tail, supervise=True, only_hosts=[host], deliver_alerts=False)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


# ----------------------------------------------------------------------------------------------- alerts


@alerts_app.command("ls")
def alerts_ls(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """List alerts, newest first."""
    alerts = _run(lambda ctl: ctl.list_alerts())
    if as_json:
        _json([a.model_dump(mode="json") for a in alerts])
        return
    table = Table("id", "severity", "rule", "run", "host", "message", "delivered")
    for a in alerts:
        table.add_row(
            str(a.id),
            Text(a.severity),
            Text(a.rule),
            Text(a.run_id or ""),
            Text(a.host or ""),
            Text(a.message),
            "yes" if a.delivered else "no",
        )
    out.print(table)


# ----------------------------------------------------------------------------------------------- serve, demo


@app.command("serve")
def serve(
    bind: Annotated[
        str | None, typer.Option("--bind", help="address to listen on (default 127.0.0.1)")
    ] = None,
    port: Annotated[int | None, typer.Option("--port", help="port (default 8765)")] = None,
) -> None:
    """Run the controller and the web UI."""
    from web.app import serve as serve_web

    settings = Settings()
    serve_web(settings, bind or settings.bind, settings.port if port is None else port)


@app.command("demo")
def demo() -> None:
    """Run the embedded demo (local agent, tiny model, web UI)."""
    from controller.demo import run_demo

    run_demo()


def main() -> None:
    """Console-script entry point."""
    app()
