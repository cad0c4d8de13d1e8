"""Wire protocol between controller and agent daemon: JSON lines, pure encode/decode, no I/O.

How it works
------------
One JSON object per line, UTF-8, ``\\n``-terminated, in both directions, over the daemon's Unix socket
(``eaglewatch-agent connect`` bridges stdin/stdout to it, which is what the controller runs over SSH).

1. On connect the daemon sends ``{"type": "hello", "agent_version": "0.1.0", "protocol": 1,
   "hostname": ..., "pid": ..., "socket": ...}`` before anything else; ``socket`` (absolute path of the
   daemon's Unix socket; absent from older daemons) lets an SSH client open a ``direct-streamlocal``
   channel straight to it instead of running the ``connect`` bridge.
2. The client sends requests ``{"id": <int|str>, "op": <op>, ...args}``.  Every request gets exactly one
   reply carrying the same ``id``: ``{"type": "reply", "id": ..., "ok": true, "result": {...}}`` or
   ``{"type": "error", "id": ..., "code": <ErrorCode>, "message": "..."}``.  A line that is not JSON, not an
   object, too long, nested too deeply, carries an ``id`` that is not an integer in [-2**63, 2**63] or a
   string of at most 256 characters, or names an unknown op gets an error reply (``id`` null when it could
   not be read) and the connection carries on.
3. ``follow`` additionally streams, after its reply, messages tagged with the run:
   ``{"type": "event", "run": R, "event": {<journal event>}}`` for every journal event with
   ``seq > after_seq`` (first the backlog from ``runs/<R>/events.jsonl``, then live ones, strictly in seq
   order, never twice on one connection; the daemon frames each journal line as it is, undecoded:
   ``event_frames``) and, when ``log_offset`` was given, the log's complete lines from that stream offset
   on, in blocks (one JSON string for many lines: no JSON object or array per line on either side):
   ``{"type": "log_block", "run": R, "offset": S, "next_offset": N, "text": "a\\nb", "offsets"?: [...]}``:
   the complete lines from stream offset ``S`` joined by ``\\n`` (a line's text never holds ``\\n`` or
   ``\\r``), ``N`` the offset after the last of them.  Stream offsets are byte offsets in ``output.log``
   that run on from where the previous file ended once it was truncated or replaced
   (agent/logs/generations.py): distinct and increasing for every line of the run, so the receiver
   stores lines idempotently; ``log_offset`` and ``status``'s ``log_size`` are stream offsets too (the
   same numbers while the log was never cut).  ``offsets`` (each line's start) is sent only when they are
   not the natural ones, ``S`` plus the UTF-8 length + 1 of each line before (``natural_offsets``): where
   bytes were replaced or stripped, a ``\\r\\n`` ended a line, a line was cut or a log generation ended.
   On the wire ``text`` is not a JSON string: the line carries ``"size": B`` in its place and is followed
   by the B bytes of the text (UTF-8) and a ``\\n`` (``encode``; read with ``attach_payload``), so neither
   side escapes or scans the text character by character.
   ``unfollow`` ends the stream.

Requests (args → result):
- ``version`` → ``{"agent_version", "protocol", "python", "hostname"}``
- ``launch {run, spec}`` → ``{"run", "pid", "start_time", "argv"}``; ``spec`` is a run spec dict
  (agent/spec.py); backend ``command`` runs ``spec.command``, the others run ``eaglewatch-agent extract``.
  Optional ``scheduler``: ``{"kind": "slurm", "partition"?, "account"?, "sbatch_args"?: [str],
  "gpus"?: "gpus-per-task" | "gres" | "none", "shards"?: N, "tasks"?: [i...]}`` (agent/sched/options.py)
  submits the run with ``sbatch`` instead of starting it; the result is then ``{"run", "pid": null,
  "start_time": null, "argv", "scheduler": "slurm", "job_id"}``. With ``shards`` (and no ``spec.shard``) it
  is one array job of N tasks (only the task ids ``tasks`` where given: a cluster's share of a sharded run),
  task i running the spec with ``shard {"index": i, "count": N}``; its milestones carry ``fields.shard``,
  and each task that ends gets a ``task_ended`` milestone (``shard``, ``slurm_state``, ``outcome``:
  completed | failed | stopped, ``reason``).
- ``stop {run, grace_s?}`` → ``{"run", "killed": [{"pid", "cmdline", "signal"}], "remaining": [pid...],
  "confirmed": bool, "gpu_released": bool | null}`` (``gpu_released``: no killed pid still holds GPU memory
  according to nvidia-smi; null where there is no GPU)
- ``list`` → ``{"runs": [<status>...]}``; ``status {run}`` → ``<status>`` =
  ``{"run", "state", "pid", "start_time", "exit": {"code", "signal"} | null, "last_seq", "log_size"}``
  with ``state`` one of ``running | completed | failed | stopped | lost`` (``pending`` while a Slurm job
  waits in the queue) and, for a Slurm job, ``scheduler``: ``{"job_id", "array", "phase", "state",
  "reason", "position", "tasks", "error", "vanished"?}``; ``stop`` of a Slurm job is one ``scancel``
  (``killed`` empty, ``job_id``, ``scheduler_state``, ``confirmed`` once Slurm reports it ended).
- ``follow {run, after_seq=0, log_offset?}`` → ``{"run", "last_seq"}`` then the stream above;
  ``unfollow {run}``.
- ``read_log {run, offset=0, limit=65536}`` → ``{"run", "offset", "next_offset", "size", "data"}``
  (``data`` decoded as UTF-8 with replacement).
- ``check {path, layers?, hidden_size?}`` → the report of ``eaglewatch-agent check --json``.
- ``gpus`` → ``{"gpus": [{"index", "uuid", "name", "memory_total_mib", "memory_used_mib",
  "utilization_pct", "temperature_c"}], "processes": [{"pid", "gpu_uuid", "used_memory_mib"}]}``
  (empty lists where there is no GPU / no nvidia-smi).
- ``shutdown`` → ``{"stopping": true}``: the daemon exits cleanly, leaving every job running (agent upgrade).

Journal events (one JSON object per line in ``runs/<R>/events.jsonl``; ``seq`` starts at 1, +1 each):
- ``{"seq", "ts", "type": "state", "state", "exit"?, "reason"?}``
- ``{"seq", "ts", "type": "milestone", "kind", "line", "rank", "fields", "text"}``
- ``{"seq", "ts", "type": "check", "file", "ok", "format", "problems": [{"code", "file", "message"}],
  "shapes"?}`` (``shapes``: tensor name → shape read)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import accumulate
from typing import Any

PROTOCOL_VERSION = 1
#: Longest request line the daemon accepts; longer lines are discarded and answered with ``too_long``.
MAX_LINE_BYTES = 1 << 20
#: Bounds of a request ``id``: it is echoed in every reply, so it must stay small.
MAX_INT_ID = 1 << 63
MAX_STR_ID = 256


class Op(StrEnum):
    """Request operations understood by the daemon."""

    VERSION = "version"
    LAUNCH = "launch"
    STOP = "stop"
    LIST = "list"
    STATUS = "status"
    FOLLOW = "follow"
    UNFOLLOW = "unfollow"
    READ_LOG = "read_log"
    CHECK = "check"
    GPUS = "gpus"
    FORECAST = "forecast"
    MANIFEST = "manifest"
    SHUTDOWN = "shutdown"


class ErrorCode(StrEnum):
    """Stable error codes carried by ``{"type": "error"}`` replies."""

    BAD_JSON = "bad_json"
    NOT_AN_OBJECT = "not_an_object"
    TOO_LONG = "too_long"
    UNKNOWN_OP = "unknown_op"
    BAD_ARGS = "bad_args"
    NOT_FOUND = "not_found"
    CONFLICT = "conflict"
    FAILED = "failed"
    INTERNAL = "internal"


class ProtocolError(Exception):
    """A message that cannot be accepted or a request that cannot be served; ``code`` is the ErrorCode to
    send back."""

    def __init__(self, code: ErrorCode, message: str, request_id: Any = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


@dataclass(frozen=True)
class Request:
    """A decoded client request."""

    id: Any
    op: Op
    args: dict[str, Any] = field(default_factory=dict)


_REQUIRED: dict[Op, tuple[str, ...]] = {
    Op.LAUNCH: ("run", "spec"),
    Op.STOP: ("run",),
    Op.STATUS: ("run",),
    Op.FOLLOW: ("run",),
    Op.UNFOLLOW: ("run",),
    Op.READ_LOG: ("run",),
    Op.CHECK: ("path",),
    Op.FORECAST: ("spec",),
    Op.MANIFEST: ("run",),
}


def decode_request(line: bytes | str) -> Request:
    """Parse one request line; raise ProtocolError naming what is wrong."""
    if isinstance(line, bytes):
        if len(line) > MAX_LINE_BYTES:
            raise ProtocolError(ErrorCode.TOO_LONG, f"line of {len(line)} bytes exceeds {MAX_LINE_BYTES}")
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProtocolError(ErrorCode.BAD_JSON, f"line is not valid UTF-8 ({exc.reason})") from None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ProtocolError(
            ErrorCode.BAD_JSON, f"line is not JSON: {exc.msg} at column {exc.colno}"
        ) from None
    except ValueError as exc:  # an integer of more than 4300 digits
        raise ProtocolError(ErrorCode.BAD_JSON, f"line is not usable JSON: {str(exc)[:200]}") from None
    except RecursionError:
        raise ProtocolError(ErrorCode.BAD_JSON, "line is not usable JSON: nested too deeply") from None
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.NOT_AN_OBJECT, f"expected a JSON object, got {type(obj).__name__}")
    req_id = obj.get("id")
    if req_id is not None and not isinstance(req_id, (int, str)):
        raise ProtocolError(ErrorCode.BAD_ARGS, "'id' must be an integer or a string")
    if isinstance(req_id, int) and not -MAX_INT_ID <= req_id <= MAX_INT_ID:
        raise ProtocolError(ErrorCode.BAD_ARGS, "'id' must be an integer in [-2**63, 2**63]")
    if isinstance(req_id, str) and len(req_id) > MAX_STR_ID:
        raise ProtocolError(ErrorCode.BAD_ARGS, f"'id' must be a string of at most {MAX_STR_ID} characters")
    raw_op = obj.get("op")
    if not isinstance(raw_op, str):
        raise ProtocolError(ErrorCode.BAD_ARGS, "missing string field 'op'", req_id)
    try:
        op = Op(raw_op)
    except ValueError:
        known = ", ".join(o.value for o in Op)
        raise ProtocolError(
            ErrorCode.UNKNOWN_OP, f"unknown op {raw_op[:64]!r} (known: {known})", req_id
        ) from None
    args = {k: v for k, v in obj.items() if k not in ("id", "op")}
    missing = [name for name in _REQUIRED.get(op, ()) if name not in args]
    if missing:
        raise ProtocolError(
            ErrorCode.BAD_ARGS, f"op {op.value!r} needs field(s) {', '.join(missing)}", req_id
        )
    return Request(id=req_id, op=op, args=args)


#: Largest raw payload after a ``log_block`` line that a reader accepts.
MAX_PAYLOAD_BYTES = 64 << 20


def encode(message: dict[str, Any]) -> bytes:
    """Serialise one message as a JSON line; a ``log_block``'s text follows its line raw (see above)."""
    if message.get("type") == "log_block":
        body = message["text"].encode("utf-8", "replace")
        head = {k: v for k, v in message.items() if k != "text"}
        head["size"] = len(body)
        return (
            json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode("utf-8") + b"\n" + body + b"\n"
        )
    return json.dumps(message, separators=(",", ":"), ensure_ascii=False).encode("utf-8") + b"\n"


def payload_size(message: dict[str, Any]) -> int | None:
    """How many bytes (the trailing newline included) follow this decoded line raw; None: none follow."""
    if message.get("type") != "log_block":
        return None
    size = message.get("size")
    if type(size) is not int or not 0 <= size <= MAX_PAYLOAD_BYTES:
        raise ProtocolError(
            ErrorCode.BAD_ARGS, f"log_block 'size' must be an integer in [0, {MAX_PAYLOAD_BYTES}]"
        )
    return size + 1


def attach_payload(message: dict[str, Any], payload: bytes) -> dict[str, Any]:
    """The message with the raw text that followed its line (``payload_size`` bytes) as ``text``."""
    if len(payload) != message["size"] + 1 or not payload.endswith(b"\n"):
        raise ProtocolError(ErrorCode.BAD_JSON, "log_block payload is not its 'size' bytes and a newline")
    out = {k: v for k, v in message.items() if k != "size"}
    out["text"] = payload[:-1].decode("utf-8", "replace")
    return out


def hello(agent_version: str, hostname: str, pid: int, socket: str) -> dict[str, Any]:
    """The first message the daemon sends on every connection (``socket``: where it listens, absolute)."""
    return {
        "type": "hello",
        "agent_version": agent_version,
        "protocol": PROTOCOL_VERSION,
        "hostname": hostname,
        "pid": pid,
        "socket": socket,
    }


def reply(request_id: Any, result: dict[str, Any]) -> dict[str, Any]:
    """A successful reply to request ``request_id``."""
    return {"type": "reply", "id": request_id, "ok": True, "result": result}


def error(request_id: Any, code: ErrorCode, message: str) -> dict[str, Any]:
    """An error reply; ``request_id`` is None when the request could not be read."""
    return {"type": "error", "id": request_id, "code": code.value, "message": message}


def _event_head(run: str) -> bytes:
    """What every ``event`` message of ``run`` starts with, up to its event object."""
    return b'{"type":"event","run":' + json.dumps(run, ensure_ascii=False).encode("utf-8") + b',"event":'


def event_frames(run: str, raw_events: list[bytes]) -> bytes:
    """The encoded ``event`` messages for journal lines ``raw_events`` (strict JSON, as the journal holds
    them): framed as they are, byte for byte what ``encode`` gives for ``{"type": "event", "run": run,
    "event": json.loads(raw)}``, without decoding or encoding any of them."""
    head = _event_head(run)
    return b"".join(head + raw + b"}\n" for raw in raw_events)


def event_block_frames(run: str, lines: bytes) -> bytes:
    """``event_frames`` for journal lines given as they lie in the file (each ending in a newline, none
    holding one: strict JSON escapes it), framed with no Python step per line."""
    if not lines:
        return b""
    head = _event_head(run)
    return head + lines[:-1].replace(b"\n", b"}\n" + head) + b"}\n"


def natural_offsets(offset: int, text: str, texts: list[str] | None = None) -> list[int]:
    """Start offsets of a block's lines when each takes its UTF-8 length plus one newline byte, and, last,
    the offset after them (C-level maps: no Python code runs per line); ``texts``: ``text`` split."""
    texts = text.split("\n") if texts is None else texts
    sizes = map(len, texts) if text.isascii() else map(len, map(str.encode, texts))
    return list(accumulate(map((1).__add__, sizes), initial=offset))


def log_block(
    run: str, offsets: list[int], text: str, next_offset: int, texts: list[str] | None = None
) -> dict[str, Any]:
    """A streamed block of log lines: ``text`` their texts joined by ``\\n`` (``texts``: the lines, if at
    hand), ``offsets`` their start offsets (sent only when they are not the natural ones), ``next_offset``
    the offset after them."""
    if text.count("\n") != len(offsets) - 1:
        raise ValueError(f"a block of {len(offsets)} lines needs {len(offsets) - 1} newlines in its text")
    msg: dict[str, Any] = {
        "type": "log_block", "run": run, "offset": offsets[0], "next_offset": next_offset, "text": text
    }  # fmt: skip
    natural = natural_offsets(offsets[0], text, texts)
    if natural[:-1] != offsets:
        msg["offsets"] = offsets
    return msg


def decode_message(line: bytes | str) -> dict[str, Any]:
    """Parse one daemon→client line (controller side); raise ProtocolError when malformed."""
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError) as exc:  # bad JSON or UTF-8, huge ints, deep nesting
        raise ProtocolError(
            ErrorCode.BAD_JSON, f"daemon sent a line that is not JSON: {str(exc)[:200]}"
        ) from None
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
        raise ProtocolError(ErrorCode.NOT_AN_OBJECT, "daemon sent a message without a string 'type'")
    return obj
