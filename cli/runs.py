"""``eaglewatch runs …``: start, list, show, stop and follow runs."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Column, Table
from rich.text import Text

from agent.backends import Backend
from cli.common import (
    JSON_FLAG,
    MILESTONE_STYLE,
    STATE_STYLE,
    err,
    invalid,
    out,
    print_json,
    run_ctl,
    run_state_text,
    shard_lines,
)
from cli.terminal import TerminalView, exit_words, words
from controller.errors import SpecInvalid
from controller.lifecycle import is_terminal
from controller.models import parse_run_spec
from controller.verdict import group_problems
from web.capture_card import capture_card, sharded_capture_card

runs_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Extraction runs.")


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
    host: Annotated[
        list[str] | None,
        typer.Option("--host", help="host name, repeatable for a sharded run (with --again: the run's host)"),
    ] = None,
    again: Annotated[
        str | None,
        typer.Option("--again", metavar="RUN", help="start from RUN's spec; other options change it"),
    ] = None,
    command: Annotated[list[str] | None, typer.Argument(help="after --: a command to run and watch")] = None,
    spec_file: Annotated[Path | None, typer.Option("--spec", help="run spec JSON (or TOML) file")] = None,
    as_json: Annotated[bool, JSON_FLAG] = False,
    name: Annotated[
        str | None, typer.Option("--name", help="a short label: letters, digits, '.', '_', '-'")
    ] = None,
    backend: Annotated[
        str | None,
        typer.Option("--backend", help=" | ".join(Backend)),
    ] = None,
    model: Annotated[
        str | None, typer.Option("--model", help="absolute path of the model directory on the host")
    ] = None,
    dataset: Annotated[
        str | None, typer.Option("--dataset", help="absolute path of the JSONL dataset on the host")
    ] = None,
    output_dir: Annotated[
        str | None,
        typer.Option("--output-dir", help="absolute path on the host for the capture files (a new one)"),
    ] = None,
    layers: Annotated[str | None, typer.Option("--layers", help="comma-separated layer ids")] = None,
    layer_convention: Annotated[
        str | None, typer.Option("--layer-convention", help="input | output: what layer id N means")
    ] = None,
    tp: Annotated[int | None, typer.Option("--tensor-parallel-size", "--tp", help="GPUs per engine")] = None,
    max_samples: Annotated[
        int | None, typer.Option("--max-samples", help="capture at most this many samples")
    ] = None,
    seq_len: Annotated[int | None, typer.Option("--seq-len", help="tokens per sample at most")] = None,
    batch_size: Annotated[int | None, typer.Option("--batch-size", help="samples per engine batch")] = None,
    env: Annotated[list[str] | None, typer.Option("--env", help="KEY=VALUE (repeatable)")] = None,
    vllm_arg: Annotated[
        list[str] | None, typer.Option("--vllm-arg", help="extra engine argument (repeatable)")
    ] = None,
    expect_layers: Annotated[
        int | None,
        typer.Option("--expect-layers", help="layers each file must hold (default: from the spec)"),
    ] = None,
    expect_hidden_size: Annotated[
        int | None,
        typer.Option("--expect-hidden-size", help="hidden size each file must have (default: the model's)"),
    ] = None,
    on_shape_failure: Annotated[str | None, typer.Option("--on-shape-failure", help="alert | stop")] = None,
    shards: Annotated[
        int | None, typer.Option("--shards", help="split the dataset into N shard jobs over the hosts' GPUs")
    ] = None,
    time_limit: Annotated[
        int | None, typer.Option("--time-limit-minutes", help="Slurm hosts: the job's time limit (--time)")
    ] = None,
) -> None:
    """Start a run; prints its id ({"id": …} with --json)."""
    spec: dict[str, Any] = {}
    if again is not None:
        spec = dict(run_ctl(lambda ctl: ctl.get_run(again)).spec)
        spec.pop("resume", None)  # a run started again is a new capture, never a resume
    elif not host:
        err.print(
            Text("error: --host is required (or --again RUN to reuse a run's spec and host)", style="red")
        )
        raise typer.Exit(2)
    if spec_file is not None:
        try:
            text = spec_file.read_text()
            if spec_file.suffix == ".toml":
                import tomllib

                from_file = tomllib.loads(text)
            else:
                from_file = json.loads(text)
        except (OSError, ValueError) as exc:
            err.print(Text(f"error: cannot read spec {spec_file}: {exc}", style="red"))
            raise typer.Exit(2) from None
        if not isinstance(from_file, dict):
            err.print(Text(f"error: spec {spec_file} must hold an object", style="red"))
            raise typer.Exit(2)
        spec.update(from_file)  # with --again: the file's fields change the earlier run's
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
            "shards": shards,
            "time_limit_minutes": time_limit,
        }
        spec.update({k: v for k, v in opts.items() if v is not None})
        if env:
            bad = [e for e in env if "=" not in e]
            if bad:
                raise SpecInvalid([{"field": "env", "message": f"expected KEY=VALUE, got {bad[0]!r}"}])
            names = [e.split("=", 1)[0] for e in env]
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                # the last one winning silently would launch with a value the user may not have meant
                message = f"--env {twice[0]} given more than once; give each variable once"
                raise SpecInvalid([{"field": "env", "message": message}])
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
        invalid(exc)
    if host:
        spec["host"] = host[0] if len(host) == 1 else list(host)
    if command:
        spec["command"] = list(command)
        spec.setdefault("backend", Backend.COMMAND)
    _create(spec, as_json)


def _create(spec: dict[str, Any], as_json: bool) -> None:
    """Check ``spec``, create and launch the run, print its id; exit 1 when it failed at once."""

    async def go(ctl: Any) -> Any:
        run_id = await ctl.create_run(parse_run_spec(spec))
        return await ctl.get_run(run_id)

    _started(run_ctl(go), {} if as_json else None)


def _started(run: Any, as_json: dict[str, Any] | None, note: str | None = None) -> None:
    """Print a new run's id and ``note`` (--json: ``{"id", **as_json}``); exit 1 if it failed at once."""
    if as_json is not None:
        print_json({"id": run.id, **as_json})
    else:
        out.print(run.id)
        if note:
            err.print(Text(note))
    if run.state == "failed":
        err.print(Text(f"run {run.id} failed: {run.failure_reason}", style="red"))
        raise typer.Exit(1)


@runs_app.command("attach")
def runs_attach(
    host: Annotated[str, typer.Option("--host", help="the host the job runs on")],
    pid: Annotated[int | None, typer.Option("--pid", help="follow this process and its descendants")] = None,
    log: Annotated[
        str | None, typer.Option("--log", help="absolute path of the job's log on the host")
    ] = None,
    from_now: Annotated[
        bool, typer.Option("--from-now", help="take the log's milestones from now on (default: its start)")
    ] = False,
    output_dir: Annotated[
        str | None, typer.Option("--output-dir", help="check the capture files the job writes there")
    ] = None,
    model: Annotated[
        str | None, typer.Option("--model", help="model directory on the host: expectations from config.json")
    ] = None,
    expect_layers: Annotated[
        int | None, typer.Option("--expect-layers", help="layers each captured file must hold")
    ] = None,
    expect_hidden_size: Annotated[
        int | None, typer.Option("--expect-hidden-size", help="hidden size each captured file must have")
    ] = None,
    slurm_job: Annotated[str | None, typer.Option("--slurm-job", help="a Slurm job id on the host")] = None,
    allow_stop: Annotated[
        bool, typer.Option("--allow-stop", help="runs stop may signal the job (default: stop only detaches)")
    ] = False,
    idle_timeout: Annotated[
        int | None, typer.Option("--idle-timeout", help="stop watching after this many seconds of no news")
    ] = None,
    name: Annotated[str | None, typer.Option("--name", help="a short label")] = None,
    as_json: Annotated[bool, JSON_FLAG] = False,
) -> None:
    """Watch a job eaglewatch did not start (a pid, a log, an output dir, a Slurm job); prints its id."""
    attach = {
        "pid": pid,
        "log": log,
        "from_start": not from_now,
        "slurm_job": slurm_job,
        "allow_stop": allow_stop,
        "idle_timeout_s": idle_timeout,
    }
    expect = {"layers": expect_layers, "hidden_size": expect_hidden_size}
    spec: dict[str, Any] = {
        "host": host,
        "attach": {k: v for k, v in attach.items() if v is not None},
        "expect": {k: v for k, v in expect.items() if v is not None},
    }
    spec.update({k: v for k, v in (("name", name), ("output_dir", output_dir), ("model", model)) if v})
    _create(spec, as_json)


NO_REFRESH = typer.Option(
    "--no-refresh",
    "--offline",
    help="answer from the local database only, without asking the hosts' agents first",
)


async def _refreshed(ctl: Any, hosts: set[str]) -> None:
    """Catch the hosts' unfinished runs up from their agents; name each host that did not answer."""
    hosts = {name for names in hosts for name in names.split(",")}  # a sharded run names its hosts so
    for fresh in await ctl.refresh(hosts):
        if not fresh.ok:
            err.print(Text(fresh.describe(), style="yellow"))


@runs_app.command("ls")
def runs_ls(
    as_json: Annotated[bool, JSON_FLAG] = False,
    no_refresh: Annotated[bool, NO_REFRESH] = False,
) -> None:
    """List runs, newest first (unfinished runs caught up from their hosts first)."""

    async def go(ctl: Any) -> Any:
        if not no_refresh:
            await _refreshed(ctl, {r.host for r in await ctl.list_runs() if not is_terminal(r.state)})
        return await ctl.list_runs()

    runs = run_ctl(go)
    if as_json:
        print_json([r.model_dump(mode="json") for r in runs])
        return
    table = Table("name", "host", "backend", "state", "last milestone", "progress", "alerts")
    table.columns.insert(0, Column("id", no_wrap=True, min_width=22))
    for r in runs:
        prog = r.progress or {}
        progress = str(prog["samples_done"]) if "samples_done" in prog else ""
        if progress and prog.get("samples_total") is not None:  # SpecForge's bar knows no total
            progress += f"/{prog['samples_total']}"
        table.add_row(
            Text(r.id),
            Text(r.name),
            Text(r.host),
            Text(r.backend),
            run_state_text(r.state, r.verdict, r.verdict_text),
            Text(r.last_milestone or ""),
            Text(progress),
            str(r.open_alerts or ""),
        )
    out.print(table)


#: How many of the last milestones ``runs show`` prints in words.
LAST_MILESTONES = 6


def show_lines(run: Any) -> list[Text]:
    """A run in words, most useful first: verdict, what it is, exit, progress, shapes, problems, alerts and
    its last milestones (passing checks counted into batch lines; failed ones are the problems above)."""
    lines = [Text.assemble((run.id, "bold"), "  ", run_state_text(run.state, run.verdict, run.verdict_text))]
    lines.append(
        Text(
            f"  {run.name} on {run.host}, backend {run.backend}"
            + (f", model {run.model}" if run.model else "")
        )
    )
    if (ended := exit_words(run.exit)) is not None:
        lines.append(Text(f"  exit: {ended}"))
    if attach := run.spec.get("attach"):
        watched = ", ".join(f"{k} {attach[k]}" for k in ("pid", "slurm_job", "log") if attach.get(k))
        stop = "stop signals it" if attach.get("allow_stop") else "stop only detaches"
        lines.append(Text(f"  attached: {watched or 'output_dir'}, not started by eaglewatch; {stop}"))
        if run.exit is not None and ended is None:
            lines.append(Text("  exit: unknown (a job eaglewatch did not start leaves it no exit status)"))
    if run.failure_reason:
        lines.append(Text(f"  failure: {run.failure_reason}", style="red"))
    if run.progress:
        lines.append(Text("  " + words("progress", run.progress)))
    card = (sharded_capture_card if run.shards else capture_card)(run.spec, run.milestones)
    if card is not None and card.layers is not None:
        shape = f", hidden_states {card.expected_shape}" if card.expected_shape else ""
        lines.append(Text(f"  capture: layers {card.layers} ({card.convention} convention), hidden size "
                          f"{card.hidden_size}, {card.dtype}{shape}"))  # fmt: skip
    if card is not None and card.shape_differs and card.shapes:
        lines.append(Text(f"  read: hidden_states {card.shapes['hidden_states']}", style="red"))
    lines.extend(shard_lines(run.shards or []))
    rows = [(p.code, p.file, p.message) for p in run.problems]
    for g in group_problems(rows, run.spec.get("output_dir")):
        files = "file" if g.count == 1 else "files"
        lines.append(
            Text(f"  problem {g.code} in {g.count} {files} ({g.files_text}): {g.message}", style="red")
        )
    for a in run.alerts:
        lines.append(Text(f"  alert [{a.severity}] {a.rule}: {a.message}", style="yellow"))
    view, said = TerminalView(), list[tuple[str, str | None]]()
    for m in run.milestones:
        if m.kind != "shape_check_failed":
            shard = "" if m.shard is None else f"[{m.shard}] "
            said.extend((shard + t, k) for t, k in view.stored(m.kind, m.fields, m.text))
    said.extend(view.flush())
    if said:
        lines.append(Text(f"  last milestones ({len(run.milestones)} in all; --raw lists each as recorded):"))
        lines.extend(
            Text(f"    {t}", style=MILESTONE_STYLE.get(k or "", "")) for t, k in said[-LAST_MILESTONES:]
        )
    return lines


@runs_app.command("show")
def runs_show(
    run_id: Annotated[str, typer.Argument(metavar="RUN", help="the run's id")],
    as_json: Annotated[
        bool, typer.Option("--json", help="the whole record as JSON (GET /api/runs/{id})")
    ] = False,
    raw: Annotated[bool, typer.Option("--raw", help="each milestone as recorded, after the summary")] = False,
    no_refresh: Annotated[bool, NO_REFRESH] = False,
) -> None:
    """Show a run in words: verdict, shapes, problems and its last milestones, caught up from its host."""

    async def go(ctl: Any) -> Any:
        run = await ctl.get_run(run_id)
        if no_refresh or is_terminal(run.state):
            return run
        await _refreshed(ctl, {run.host})
        return await ctl.get_run(run_id)

    run = run_ctl(go)
    if as_json:
        print_json(run.model_dump(mode="json"))
        return
    for line in show_lines(run):
        out.print(line)
    if raw:
        for m in run.milestones:
            shard = "" if m.shard is None else f"[{m.shard}] "
            out.print(
                Text.assemble("  ", shard, (f"{m.kind:<22}", MILESTONE_STYLE.get(m.kind, "cyan")), m.text)
            )


@runs_app.command("resume")
def runs_resume(
    run_id: Annotated[str, typer.Argument(metavar="RUN")],
    as_json: Annotated[bool, JSON_FLAG] = False,
    shard: Annotated[
        int | None,
        typer.Option("--shard", help="a sharded run: resume only this shard (default: all failed)"),
    ] = None,
) -> None:
    """Resume a failed or stopped extraction: a new run, same spec and output directory; prints its id.

    A sharded run resumes its failed shards (or --shard i) as new jobs; while it runs it stays one run."""

    async def go(ctl: Any) -> Any:
        return await ctl.get_run(await ctl.resume_run(run_id, shard))

    note = f"resumes {run_id}: files already written are kept, only missing ones are captured"
    _started(run_ctl(go), {"resumes": run_id} if as_json else None, note)


def card_lines(card: dict[str, Any]) -> list[str]:
    """A dataset card in words: what was captured, how much, with what, and each layer's statistics."""
    versions = card.get("versions") or {}
    digest = str(card.get("model_config_sha256") or "?")[:16]
    vllm = card.get("vllm_version") or versions.get("vllm")
    lines = [
        f"model       {card.get('model')}  (config.json sha256 {digest}…)",
        f"layers      {card.get('layer_ids')} ({card.get('layer_convention')} convention), hidden "
        f"{card.get('hidden_size')}, {card.get('dtype')}",
        f"format      {card.get('format')} v{card.get('format_version')}, backend {card.get('backend')}",
        f"samples     {card.get('samples_written')} of {card.get('samples_total')} written, "
        f"{card.get('tokens_total')} tokens, {card.get('bytes_written')} bytes this attempt",
        f"versions    vLLM {vllm}, torch {versions.get('torch')}, "
        f"transformers {versions.get('transformers')}, Python {versions.get('python')}",
    ]
    stats = card.get("layer_stats") or {}
    if stats:
        lines.append("layer       rms         max_abs     zero_frac   non_finite")
        for layer, s in sorted(stats.items(), key=lambda kv: int(kv[0]) if str(kv[0]).isdigit() else 0):
            lines.append(
                f"{layer:<11} {s.get('rms', 0):<11.4g} {s.get('max_abs', 0):<11.4g} "
                f"{s.get('zero_fraction', 0):<11.4g} {s.get('non_finite', 0)}"
            )
    return lines


@runs_app.command("card")
def runs_card(
    run_id: Annotated[str, typer.Argument(metavar="RUN")],
    as_json: Annotated[bool, JSON_FLAG] = False,
) -> None:
    """Print a run's dataset card: its manifest.json on the host (totals, layer stats, versions, spec)."""
    card = run_ctl(lambda ctl: ctl.run_card(run_id))
    if as_json:
        print_json(card)
        return
    for line in card_lines(card):
        out.print(Text(line))


@runs_app.command("stop")
def runs_stop(run_id: Annotated[str, typer.Argument(metavar="RUN")]) -> None:
    """Stop a run through its host's agent."""
    run = run_ctl(lambda ctl: ctl.stop_run(run_id))
    out.print(Text(f"{run.id}: {run.state}"))


def _printer(raw: bool) -> Callable[[str | None, set[str]], None]:
    """Print log lines: verbatim with ``raw``, else through a TerminalView (markers in words, one line per
    batch); ``None`` means the input paused or ended (a waiting batch line is printed)."""
    view = TerminalView()

    def show(text: str | None, marks: set[str]) -> None:
        if text is None:
            shown = view.flush()
        elif raw:
            shown = [(text, "log" if text in marks else None)]
        else:
            shown = [
                (t, k if k is not None else ("log" if text in marks else None)) for t, k in view.line(text)
            ]
        for line, kind in shown:
            style = (
                "bold magenta" if kind == "log" else MILESTONE_STYLE.get(kind or "", "cyan" if kind else "")
            )
            out.print(Text(line, style=style))

    return show


@runs_app.command("logs")
def runs_logs(
    run_id: Annotated[str, typer.Argument(metavar="RUN")],
    follow: Annotated[bool, typer.Option("-f", "--follow", help="keep printing new lines")] = False,
    raw: Annotated[
        bool, typer.Option("--raw", help="the log as written, marker lines and all (default: in words)")
    ] = False,
) -> None:
    """Print a run's log (milestones in words, one line per batch; --raw: as written); -f follows it live."""
    show = _printer(raw)

    async def stream(ctl: Any) -> None:
        run = await ctl.get_run(run_id)
        if run.shards:  # the log lines are each shard job's own
            jobs = " ".join(s.job_id for s in run.shards)
            err.print(Text(f"run {run_id} is sharded: each shard's job has its log (runs logs JOB): {jobs}"))
            return
        if not follow and not is_terminal(run.state):
            await _refreshed(ctl, {run.host})
            run = await ctl.get_run(run_id)
        marks = {m.text for m in run.milestones}
        offset, quiet = -1, 0
        while True:
            lines = await ctl.read_log(run_id, after_offset=offset, limit=5000)
            if lines and follow:
                marks = {m.text for m in (await ctl.get_run(run_id)).milestones}
            for line in lines:
                show(line["text"], marks)
            if lines:
                offset, quiet = lines[-1]["offset"], 0
                continue
            show(None, marks)
            if not follow:
                return
            run = await ctl.get_run(run_id)
            quiet = quiet + 1 if is_terminal(run.state) else 0
            if quiet > 5:
                err.print(Text(f"-- run {run.id} {run.state}", style=STATE_STYLE.get(run.state, "")))
                return
            await asyncio.sleep(0.2)

    first = run_ctl(lambda ctl: ctl.get_run(run_id)) if follow else None
    if first is None or first.shards:  # a sharded run: names the shard jobs to follow instead
        run_ctl(stream)
        return
    try:
        run_ctl(stream, supervise=True, only_hosts=[first.host], deliver_alerts=False)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
