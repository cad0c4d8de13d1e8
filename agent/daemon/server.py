"""The agent daemon: re-adopts runs from the state dir and serves agent/protocol.py on a Unix socket."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from agent import __version__, protocol, settings
from agent.backends import OWN, Backend
from agent.daemon.connection import Connection
from agent.daemon.launch_paths import attach_error, path_error
from agent.jobs import attached, procfs
from agent.jobs import control as jobs
from agent.jobs.procfs import boot_id
from agent.logs.tail import POLL_INTERVAL_S, Inotify
from agent.milestones.engine import RuleError, load_rules
from agent.paths import RunPaths, atomic_write_json, read_json, run_paths, runs_dir, valid_run_id
from agent.protocol import ErrorCode, ProtocolError
from agent.runs.jobspec import JobSpec, SpecError
from agent.runs.journal import Journal
from agent.runs.outdir import holds_capture, launch_output_dir_error
from agent.runs.output_info import spec_capture
from agent.runs.summary import milestone_event
from agent.runs.watcher import RunWatcher
from agent.sched import jobs as sched_jobs
from agent.sched import slurm
from agent.sched.options import SlurmOptions
from agent.sched.slurmstate import JobView

log = logging.getLogger("eaglewatch.agent")


class DaemonError(Exception):
    """The daemon cannot start (another one runs, socket path unusable)."""


class Daemon:
    """One daemon per state dir: the runs it watches and the socket server.

    lock_wait_s: how long a starting daemon waits for a shutting-down one to release the state dir;
    inotify: False polls the run dirs instead (filesystems without inotify, and the tests of that path).
    """

    def __init__(
        self, state_dir: Path, socket_path: Path, lock_wait_s: float = 10.0, inotify: bool = True
    ) -> None:
        self.state_dir = state_dir
        self.lock_wait_s = lock_wait_s
        self.use_inotify = inotify
        self.socket_path = Path(os.path.abspath(socket_path))  # announced in the hello: must not be relative
        self.runs: dict[str, RunWatcher] = {}
        self.hostname = socket.gethostname()
        self.inotify: Inotify | None = None
        self.connections: set[Connection] = set()
        self._server: asyncio.AbstractServer | None = None
        self._stopping = asyncio.Event()
        self._lock_fd = -1
        self._bg: set[asyncio.Task[Any]] = set()
        #: (run, output_dir, shard claim) of launches between their output dir check and their adoption
        self._launching: list[tuple[str, str, sched_jobs.Claim]] = []
        self.slurm = sched_jobs.SlurmPoller(self._on_slurm_look)

    # --- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Take the state dir's lock, re-adopt every run, listen on the socket."""
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        runs_dir(self.state_dir).mkdir(exist_ok=True, mode=0o700)
        self._lock_fd = os.open(self.state_dir / "daemon.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        # An upgrade asks the old daemon to shut down and starts the new one at once: give it a moment.
        deadline = time.monotonic() + self.lock_wait_s
        while True:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(self._lock_fd)
                    raise DaemonError(f"another daemon already serves {self.state_dir}") from None
                await asyncio.sleep(0.1)
        os.ftruncate(self._lock_fd, 0)
        os.write(self._lock_fd, f"{os.getpid()}\n".encode())
        loop = asyncio.get_running_loop()
        try:
            if not self.use_inotify:
                raise OSError("disabled by --poll")
            self.inotify = Inotify(loop)
        except OSError as exc:
            log.warning("inotify unavailable (%s): polling every %.1f s", exc, POLL_INTERVAL_S)
        for entry in sorted(runs_dir(self.state_dir).iterdir()):
            if entry.is_dir() and valid_run_id(entry.name) and (entry / "spec.json").exists():
                try:
                    self._adopt(run_paths(self.state_dir, entry.name))
                except Exception:  # one damaged run dir must not keep the daemon (and every other run) down
                    log.exception("cannot adopt run %s; skipped", entry.name)
        await self._listen()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        loop.add_signal_handler(signal.SIGUSR2, _dump_tasks)
        log.info(
            "agent %s serving %s (state %s, %d runs)",
            __version__,
            self.socket_path,
            self.state_dir,
            len(self.runs),
        )

    async def _listen(self) -> None:
        path = self.socket_path
        if len(os.fsencode(path)) > 100:
            raise DaemonError(f"socket path {path} is too long for a Unix socket (max ~100 bytes)")
        if path.exists() or path.is_symlink():
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(path))
            except OSError:
                path.unlink()  # stale: nobody answers
            else:
                raise DaemonError(f"a daemon already listens on {path}")
            finally:
                probe.close()
        path.parent.mkdir(parents=True, exist_ok=True)
        old = os.umask(0o077)
        try:
            self._server = await asyncio.start_unix_server(
                self._on_client, path=str(path), limit=protocol.MAX_LINE_BYTES
            )
        finally:
            os.umask(old)
        self._socket_ino = path.stat().st_ino

    def request_shutdown(self) -> None:
        """Ask the daemon to exit after the current replies."""
        self._stopping.set()

    async def close(self) -> None:
        """Stop listening, end connections and watchers (cursors are saved); jobs are left alone."""
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.close()
        self.slurm.close()
        tasks = [w.task for w in self.runs.values() if w.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        for w in self.runs.values():
            w.journal.close()
        with contextlib.suppress(OSError):
            if self.socket_path.stat().st_ino == self._socket_ino:
                self.socket_path.unlink()
        if self.inotify is not None:
            self.inotify.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = Connection(self, reader, writer)
        self.connections.add(conn)
        try:
            await conn.serve()
        finally:
            self.connections.discard(conn)

    # --- runs ------------------------------------------------------------------------------------
    def _adopt(self, paths: RunPaths) -> RunWatcher:
        """Create the watcher of an existing or new run and start it unless the run has ended."""
        watcher = RunWatcher(
            paths,
            Journal(paths.events),
            JobSpec.stored(read_json(paths.spec)),
            self._agent_stop,
            polling=self.inotify is None,
        )
        self.runs[paths.run] = watcher
        job = read_json(paths.job)
        slurm_job = isinstance(job, dict) and job.get("scheduler") == "slurm"
        if slurm_job and watcher.summary.terminal is None and not paths.exit.exists():
            # re-adopted by job id after a restart, or just submitted
            self.slurm.track(paths.run, str(job.get("job_id")), sched_jobs.expected_tasks(paths))
        watcher.start()
        if watcher.task is not None and self.inotify is not None:
            key = f"run:{paths.run}"
            self.inotify.watch(key, paths.dir, watcher.wake)
            watcher.task.add_done_callback(lambda _t: self._unwatch(key))
        return watcher

    def _on_slurm_look(self, run: str, view: JobView | None, error: str | None) -> None:
        """The poller's look at one run's job: into sched.json / exit.json and the run's timeline."""
        watcher = self.runs.get(run)
        if watcher is None or watcher.summary.terminal is not None:
            self.slurm.untrack(run)
            return
        events, over = sched_jobs.apply_look(watcher.paths, view, error, getattr(watcher, "line", 0))
        if over:
            self.slurm.untrack(run)
        elif view is not None and any(e.get("kind") == "task_ended" for e in events):
            # tasks that left the queue unseen are no longer waited for (the next look, not an extra one)
            self.slurm.track(run, view.job_id, sched_jobs.expected_tasks(watcher.paths))
        watcher.note(events)

    def _unwatch(self, key: str) -> None:
        if self.inotify is not None and self.inotify.fd >= 0:
            self.inotify.unwatch(key)

    def _agent_stop(self, run: str, reason: str) -> None:
        """The agent's own stop (on_shape_failure = stop): runs in the background, final state failed."""
        watcher = self.runs[run]
        log.warning("stopping %s: %s", run, reason)
        coro = asyncio.to_thread(jobs.stop, watcher.paths, 10.0, "agent", reason)
        task = asyncio.get_running_loop().create_task(coro)
        self._bg.add(task)  # the loop keeps only a weak reference
        task.add_done_callback(self._bg.discard)

    def watcher(self, args: dict[str, Any]) -> RunWatcher:
        """The watcher named by ``args["run"]`` or an ProtocolError."""
        run = args.get("run")
        if not isinstance(run, str) or not valid_run_id(run):
            raise ProtocolError(ErrorCode.BAD_ARGS, "'run' must be a run id (letters, digits, '.', '_', '-')")
        try:
            return self.runs[run]
        except KeyError:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no run {run!r} on this host") from None

    async def launch(self, run: Any, spec: Any, scheduler: Any = None) -> dict[str, Any]:
        """Write the run record, start the job detached (or submit it to Slurm), journal ``launched`` +
        state ``running``.

        The output dir is claimed in one step of the event loop (the holders read, this claim added) and
        held until the run is adopted or refused: of two launches into one directory the second sees the
        first."""
        if not isinstance(run, str) or not valid_run_id(run):
            raise ProtocolError(
                ErrorCode.BAD_ARGS, f"run id {str(run)[:80]!r} must match ^[A-Za-z0-9][A-Za-z0-9_.-]{{0,63}}$"
            )
        try:
            view = JobSpec.parse(spec)
        except SpecError as exc:
            raise ProtocolError(ErrorCode.BAD_ARGS, str(exc)) from None
        opts = None
        if scheduler is not None:
            try:
                opts = SlurmOptions.parse(scheduler)
            except ValueError as exc:
                raise ProtocolError(ErrorCode.BAD_ARGS, str(exc)) from None
            if opts.shards and view.shard is not None:
                raise ProtocolError(ErrorCode.BAD_ARGS, "spec.shard and scheduler.shards exclude each other")
        if view.attach is not None:
            if opts is not None and view.attach.slurm_job is None:
                raise ProtocolError(ErrorCode.BAD_ARGS, "spec.attach: a Slurm host attaches to a slurm_job")
            return await self._attach(run, spec, view)
        if view.output_dir is None:
            return await self._launch(run, spec, view, opts)
        mine = sched_jobs.shard_claim(view.shard, opts)
        # Only active runs claim their directory: a later run may resume into an ended run's output.
        # Other shards of the same sharded run share it (a shard's job, or an array job's tasks still
        # going): their jobs write disjoint files and manifests.
        holders = [
            (r, w.spec.output_dir or "", sched_jobs.live_claim(w.spec.shard, w.paths))
            for r, w in self.runs.items()
            if w.summary.terminal is None
        ] + self._launching
        others = [
            (r, d) for r, d, c in holders if not sched_jobs.disjoint_shards(view.output_dir, mine, d, c)
        ]
        claim = (run, view.output_dir, mine)
        self._launching.append(claim)
        try:
            await self._check_output_dir(view, spec, others, sharded=mine is not None)
            return await self._launch(run, spec, view, opts)
        finally:
            self._launching.remove(claim)

    async def _check_output_dir(
        self, view: JobSpec, spec: Any, others: list[tuple[str, str]], sharded: bool
    ) -> None:
        """The spec's host paths, then its output dir, as an error naming the field.  A directory holding
        capture files must hold the capture the spec asks for (resolved in a child: no pydantic in the
        daemon), carried on only with ``resume`` (or by one shard among others writing there)."""
        if (unusable := await asyncio.to_thread(path_error, spec, view.backend)) is not None:
            raise ProtocolError(ErrorCode.BAD_ARGS, f"spec.{unusable}")
        out = view.output_dir or ""
        captured = await asyncio.to_thread(holds_capture, out)
        wanted = await spec_capture(spec, self.state_dir) if captured and view.backend in OWN else None
        err = await asyncio.to_thread(launch_output_dir_error, out, str(self.state_dir), others, wanted)
        if err is None and captured and not (view.resume or sharded):
            err = (
                f"output_dir {out[:200]!r} already holds capture files: choose another output_dir, or resume "
                "the run that wrote them (resume: true)"
            )
        if err is not None:
            raise ProtocolError(ErrorCode.BAD_ARGS, f"spec.{err}")

    def _new_run_dir(self, run: str, spec: Any, view: JobSpec) -> RunPaths:
        """Check the run's rules, make its directory (a second ``run`` is a conflict), write its spec."""
        try:
            load_rules(extra=view.rules)
        except (RuleError, TypeError) as exc:
            raise ProtocolError(ErrorCode.BAD_ARGS, f"spec.rules: {exc}") from None
        paths = run_paths(self.state_dir, run)
        try:
            paths.dir.mkdir(mode=0o700)
        except FileExistsError:
            raise ProtocolError(ErrorCode.CONFLICT, f"run {run!r} already exists on this host") from None
        atomic_write_json(paths.spec, spec)
        return paths

    async def _launch(self, run: str, spec: Any, view: JobSpec, opts: SlurmOptions | None) -> dict[str, Any]:
        paths = self._new_run_dir(run, spec, view)
        argv, env = list(view.command), dict(view.env)
        if view.backend != Backend.COMMAND:
            # the job imports the very agent package this daemon runs (vLLM's workers: its worker extension)
            pkg_root = str(Path(__file__).resolve().parents[2])
            inherited = view.env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
            env["PYTHONPATH"] = pkg_root + (os.pathsep + inherited if inherited else "")
            argv = [sys.executable, "-m", "agent", "extract", "--spec", str(paths.spec)]
        journal = Journal(paths.events)
        if opts is not None:
            return await self._submit(paths, journal, view, argv, env, opts)
        try:
            record = await asyncio.to_thread(jobs.spawn, paths, argv, env)
        except jobs.SpawnError as exc:
            journal.close()
            self._adopt(paths)  # sees exit.json (or nothing): journals failed / lost itself
            raise ProtocolError(ErrorCode.FAILED, f"cannot start run {run!r}: {exc}") from None
        text = f"launched pid {record['pid']}: {' '.join(argv)[:300]}"
        journal.append(milestone_event("launched", 0, text, pid=record["pid"], argv=argv, host=self.hostname))
        journal.append({"type": "state", "state": "running"})
        journal.close()
        self._adopt(paths)
        return _launched(run, record["pid"], record["start_time"], argv)

    async def _attach(self, run: str, spec: Any, view: JobSpec) -> dict[str, Any]:
        """Watch a job this agent did not start: recorded and adopted like a launched one (its log linked as
        output.log); nothing is spawned and an output dir is only read, so none is claimed."""
        attach = view.attach
        assert attach is not None
        if (unusable := await asyncio.to_thread(attach_error, spec, attach)) is not None:
            raise ProtocolError(ErrorCode.BAD_ARGS, f"spec.{unusable}")
        paths = self._new_run_dir(run, spec, view)
        journal = Journal(paths.events)
        record = attached.record(attach)
        followed, found = attach.log, None
        if followed is None and attach.pid is not None:
            # a job started by hand as "cmd > log 2>&1 &": its log is where its output goes
            followed = found = await asyncio.to_thread(procfs.output_file, attach.pid)
        start = None
        if followed is not None:
            # Streams, read_log and the rules read output.log: the user's log is followed by its name.
            os.symlink(followed, paths.log)
            if not attach.from_start:
                # from now on: rules, streams and reads start past the log's last complete line
                start = await asyncio.to_thread(attached.log_start, followed)
                record["log_from"] = start
        if record.get("scheduler") == "slurm":
            atomic_write_json(paths.sched, {"job_id": attach.slurm_job, "phase": "running"}, fsync=False)
        atomic_write_json(paths.job, record)
        watched = {k: v for k, v in vars(attach).items() if v is not None}
        if found is not None:
            watched["log"] = found
        what = ", ".join(f"{k} {v}" for k, v in watched.items() if k in ("pid", "log", "slurm_job"))
        what += " (its output)" if found is not None else ""
        text = f"attached to {what or 'output_dir ' + str(view.output_dir)}"[:400]
        fields = {"attached": watched, "output_dir": view.output_dir, "host": self.hostname}
        journal.append(milestone_event("launched", 0, text, **fields))
        if attach.pid is not None and followed is None:
            text = (
                f"pid {attach.pid} writes its output to a terminal or a pipe, not a file: only its process "
                "tree is followed; give attach.log to read its log"
            )
            journal.append(milestone_event("warning", 0, text, rule="attach_no_log", pid=attach.pid))
        journal.append({"type": "state", "state": "running"})
        seq = journal.last_seq
        journal.close()
        if start is not None:  # the rules' cursor (seq: what is journaled)
            atomic_write_json(paths.cursor, {"offset": start, "line": 0, "seq": seq})
        self._adopt(paths)
        return _launched(run, attach.pid, record.get("start_time"), [], attached=True)

    async def _submit(
        self,
        paths: RunPaths,
        journal: Journal,
        view: JobSpec,
        argv: list[str],
        env: dict[str, str],
        opts: SlurmOptions,
    ) -> dict[str, Any]:
        """The run as a Slurm job (an array of ``opts.shards`` tasks): sbatch, journal, poll."""
        gpus = None if view.backend == Backend.COMMAND else view.tensor_parallel_size
        try:
            job_env = {**env, settings.RUN_ID.name: paths.run}
            record = await asyncio.to_thread(
                sched_jobs.submit, paths, argv, job_env, opts, gpus, view.time_limit_minutes
            )
        except slurm.SlurmError as exc:
            journal.close()
            self._adopt(paths)  # sees exit.json: journals failed with sbatch's reason
            raise ProtocolError(ErrorCode.FAILED, f"cannot submit run {paths.run!r}: {exc}") from None
        job_id = record["job_id"]
        text = f"submitted Slurm job {job_id}: {' '.join(argv)[:300]}"
        fields = {"scheduler": "slurm", "job_id": job_id, "array": opts.shards, "argv": argv}
        journal.append(
            milestone_event("launched", 0, text, **fields, sbatch=record["sbatch"], host=self.hostname)
        )
        journal.append({"type": "state", "state": "pending", "reason": f"Slurm job {job_id} submitted"})
        journal.close()
        self._adopt(paths)
        return _launched(paths.run, None, None, argv, scheduler="slurm", job_id=job_id)


def _launched(run: str, pid: int | None, start_time: Any, argv: list[str], **extra: Any) -> dict[str, Any]:
    """The result of a ``launch`` request (agent/protocol.py)."""
    return {"run": run, "pid": pid, "start_time": start_time, "argv": argv, "boot_id": boot_id(), **extra}


def _dump_tasks() -> None:
    """`kill -USR2 <daemon>` writes every asyncio task's stack to the log (diagnosing a stuck daemon)."""
    for task in asyncio.all_tasks():
        task.print_stack(file=sys.stderr)
    sys.stderr.flush()


async def run_daemon(
    state_dir: Path, socket_path: Path, lock_wait_s: float = 10.0, inotify: bool = True
) -> int:
    """Start a daemon and serve until told to stop; exit status for the CLI."""
    try:
        daemon = Daemon(state_dir, socket_path, lock_wait_s, inotify)
        await daemon.start()
    except (DaemonError, settings.SettingError) as exc:
        print(f"eaglewatch-agent daemon: {exc}", file=sys.stderr)
        return 1
    await daemon._stopping.wait()  # SIGTERM/SIGINT or a ``shutdown`` request; the jobs keep running
    await daemon.close()
    return 0
