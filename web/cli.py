"""``eaglewatch``: the controller's commands (controller/cli.py) plus ``serve`` and ``demo`` (the web UI)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from controller.cli import app
from controller.settings import Settings


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
    home: Annotated[Path | None, typer.Option("--home", help="demo state dir")] = None,
    extract: Annotated[
        bool, typer.Option("--extract/--no-extract", help="real vLLM extraction, or a quick command job")
    ] = True,
    broken: Annotated[
        bool, typer.Option("--broken", help="also start a run whose capture drops a layer")
    ] = False,
) -> None:
    """Run the embedded demo (local agent, tiny model, web UI)."""
    from web.demo import run_demo  # imported when used: the other commands start faster

    raise typer.Exit(run_demo(home=home, bind=bind, port=port, extract=extract, broken=broken) or 0)


def main() -> None:
    """Console-script entry point."""
    app()
