"""The ``eaglewatch`` command: hosts, runs and alerts, ``serve`` (controller + web UI) and ``demo``.

Each host, run and alert command runs a short-lived Controller on the shared SQLite database.  ``runs
start``/``stop`` open a one-shot link to the host's agent (a running ``serve`` picks the new run up from the
database and follows it too; journal seq dedupe keeps both safe).  ``runs logs -f`` supervises just that
run's host while it prints.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

import agent
from cli.common import JSON_FLAG, err, invalid, out, print_json, run_ctl
from cli.runs import runs_app
from controller.bootstrap import fetch_host_key
from controller.errors import HostKeyRejected, SpecInvalid, Unreachable
from controller.models import HostCreate
from controller.settings import Settings

# Plain help: typer's rich panels print "<bool>" beside every flag, as if it took a value.
app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
    help="Launch and watch hidden-state extraction runs.",
)
hosts_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="GPU hosts reached over SSH.")
alerts_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Alerts.")
app.add_typer(hosts_app, name="hosts")
app.add_typer(runs_app, name="runs")
app.add_typer(alerts_app, name="alerts")


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
    """Launch and watch hidden-state extraction runs."""


# ----------------------------------------------------------------------------------------------- hosts


@hosts_app.command("add")
def hosts_add(
    name: str,
    ssh: Annotated[str, typer.Option("--ssh", help="SSH destination: ~/.ssh/config alias or [user@]host")],
    python: Annotated[
        str, typer.Option("--python", help="the host's Python (the one with vLLM)")
    ] = "python3",
    state_dir: Annotated[str | None, typer.Option("--state-dir", hidden=True)] = None,
    scheduler: Annotated[
        str | None, typer.Option("--scheduler", help="'slurm': a login node; runs are submitted with sbatch")
    ] = None,
    partition: Annotated[str | None, typer.Option("--partition", help="Slurm partition")] = None,
    account: Annotated[str | None, typer.Option("--account", help="Slurm account")] = None,
    sbatch_arg: Annotated[
        list[str] | None,
        typer.Option("--sbatch-arg", help="extra sbatch option --name=value (repeatable)"),
    ] = None,
    slurm_gpus: Annotated[
        str,
        typer.Option("--slurm-gpus", help="how runs ask for GPUs: gpus-per-task, gres or none (CPU nodes)"),
    ] = "gpus-per-task",
) -> None:
    """Add a host; shows its SSH key fingerprint and connects only if known_hosts trusts it."""
    from pydantic import ValidationError

    from controller.models import validation_errors

    try:
        spec = HostCreate.model_validate(
            {
                "name": name,
                "ssh": ssh,
                "python": python,
                "state_dir": state_dir,
                "scheduler": scheduler,
                "partition": partition,
                "account": account,
                "sbatch_args": sbatch_arg or [],
                "slurm_gpus": slurm_gpus,
            }
        )
    except ValidationError as exc:
        invalid(SpecInvalid(validation_errors(exc)))

    async def go(ctl: Any) -> None:
        if ssh != "local":
            try:
                fp = await fetch_host_key(ssh, ctl.settings)
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

    run_ctl(go)


@hosts_app.command("ls")
def hosts_ls(as_json: Annotated[bool, JSON_FLAG] = False) -> None:
    """List hosts."""
    hosts = run_ctl(lambda ctl: ctl.list_hosts())
    if as_json:
        print_json([h.model_dump(mode="json") for h in hosts])
        return
    table = Table("name", "ssh", "python", "reachable", "agent", "GPUs", "scheduler", "fingerprint")
    for h in hosts:
        reach = {True: "[green]yes[/]", False: "[red]no[/]", None: "?"}[h.reachable]
        table.add_row(
            Text(h.name),
            Text(h.ssh),
            Text(h.python),
            reach,
            Text(h.agent_version or "-"),
            str(len(h.gpus)),
            Text(f"slurm {h.partition or ''}".strip() if h.scheduler else "-"),
            Text(h.fingerprint or "-"),
        )
    out.print(table)


@hosts_app.command("check")
def hosts_check(name: str) -> None:
    """Connect to a host now (bootstrapping the agent) and show its GPUs."""
    host = run_ctl(lambda ctl: ctl.check_host(name))
    out.print(f"{host.name}: reachable, agent {host.agent_version}, key {host.fingerprint or '-'}")
    if host.link_route:
        why = f" ({host.link_route_reason})" if host.link_route_reason else ""
        out.print(Text(f"  link: {host.link_route}{why}"))  # the reason quotes the server: no markup
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
    run_ctl(lambda ctl: ctl.remove_host(name))
    out.print(f"removed host {name}")


# ----------------------------------------------------------------------------------------------- alerts


@alerts_app.command("ls")
def alerts_ls(as_json: Annotated[bool, JSON_FLAG] = False) -> None:
    """List alerts, newest first."""
    alerts = run_ctl(lambda ctl: ctl.list_alerts())
    if as_json:
        print_json([a.model_dump(mode="json") for a in alerts])
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


# ----------------------------------------------------------------------------------------------- history

_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_age(value: str) -> float:
    """``30d``, ``12h``, ``90m``, ``3600s`` as seconds; SpecInvalid names --older-than and the form."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd])\s*", value)
    if m is None or float(m.group(1)) <= 0:
        why = f"{value!r}: give a positive age like 30d, 12h, 90m or 3600s"
        raise SpecInvalid([{"field": "--older-than", "message": why}])
    return float(m.group(1)) * _AGE_UNITS[m.group(2)]


@app.command("gc")
def gc(
    older_than: Annotated[
        str, typer.Option("--older-than", help="age of ended runs whose log lines go: 30d, 12h, 90m, 3600s")
    ],
    as_json: Annotated[bool, JSON_FLAG] = False,
) -> None:
    """Drop the log lines of runs that ended before --older-than (milestones, verdicts, problems and specs
    stay) and shrink the database."""
    try:
        age = parse_age(older_than)
    except SpecInvalid as exc:
        invalid(exc)
    done = run_ctl(lambda ctl: ctl.gc(age))
    if as_json:
        print_json(done)
        return
    out.print(
        f"dropped {done['lines']} log lines of {done['runs']} ended runs; database "
        f"{done['bytes_before'] / 1e6:.1f} MB -> {done['bytes_after'] / 1e6:.1f} MB"
    )


# ----------------------------------------------------------------------------------------------- web UI


@app.command("serve")
def serve(
    bind: Annotated[
        str | None, typer.Option("--bind", help="address to listen on (default 127.0.0.1)")
    ] = None,
    port: Annotated[int | None, typer.Option("--port", help="port (default 8765)")] = None,
) -> None:
    """Run the controller and the web UI."""
    from web.app import serve as serve_web  # imported when used: the other commands start faster

    settings = Settings()
    serve_web(settings, bind or settings.bind, settings.port if port is None else port)


@app.command("demo")
def demo(
    bind: Annotated[str, typer.Option("--bind", help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="port (0: any free port)")] = 8765,
    home: Annotated[
        Path | None,
        typer.Option("--home", help="demo state dir (default ~/.local/share/eaglewatch-demo)"),
    ] = None,
    extract: Annotated[
        bool, typer.Option("--extract/--no-extract", help="real vLLM extraction, or a quick command job")
    ] = True,
    broken: Annotated[
        bool, typer.Option("--broken", help="also start a run whose capture drops a layer")
    ] = False,
) -> None:
    """Run the embedded demo (local agent, tiny model, web UI)."""
    from cli.demo import run_demo  # imported when used: the other commands start faster

    raise typer.Exit(run_demo(home=home, bind=bind, port=port, extract=extract, broken=broken))


def main() -> None:
    """Console-script entry point."""
    app()
