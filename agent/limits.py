"""Bounds of a run spec: one set for the pydantic model, the daemon's view and the web API's body limit.

The controller sends a whole spec in one ``launch`` request line, and the daemon discards any line over
``protocol.MAX_LINE_BYTES``; so every valid spec must fit in one line with its envelope. Each field has its
own bound (a clear error naming the field), and the spec as a whole, encoded as the controller sends it, is
held to ``MAX_SPEC_BYTES``: worst-case characters (6-byte ``\\u00XX`` escapes) can add up past the
per-field bounds.
Stdlib only: the daemon imports this module.
"""

from __future__ import annotations

import json
from typing import Any

from agent.protocol import MAX_LINE_BYTES

#: Room left in a launch line for ``{"id":…,"op":"launch","run":"<at most 64 chars>","spec":…}``.
ENVELOPE_BYTES = 4096
#: Largest spec, as compact UTF-8 JSON (what ``protocol.encode`` writes); half a line, so bounds can be read
#: at a glance and a spec re-serialised with defaults filled in still fits.
MAX_SPEC_BYTES = 512 * 1024
#: Largest HTTP request body the web app reads: one protocol line (a pretty-printed spec near MAX_SPEC_BYTES
#: still fits; anything larger could never be launched).
MAX_BODY_BYTES = MAX_LINE_BYTES

MAX_PATH_CHARS = 4096  # PATH_MAX on Linux
MAX_LAYERS = 1024
MAX_LAYER_ID = 65535
MAX_TENSOR_PARALLEL = 64
MAX_SAMPLES = 10**12
MAX_SEQ_LEN = 1 << 20
MAX_BATCH_SIZE = 4096
MAX_HIDDEN_SIZE = 1 << 20
MAX_DISK_LOW_GIB = 1 << 20  # 1 PiB
MAX_ENV_VARS = 256
MAX_ENV_NAME_CHARS = 256
MAX_ENV_VALUE_CHARS = 32768
MAX_ARGS = 1024
MAX_ARG_CHARS = 32768
MAX_RULES = 256
MAX_SHARDS = 4096
MAX_TIME_LIMIT_MINUTES = 366 * 24 * 60

assert MAX_SPEC_BYTES + ENVELOPE_BYTES < MAX_LINE_BYTES


def spec_bytes(spec: Any) -> int:
    """Size of ``spec`` as the controller sends it (compact UTF-8 JSON); UnicodeEncodeError on surrogates."""
    return len(json.dumps(spec, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))


def spec_size_problem(spec: dict[str, Any]) -> str | None:
    """Why ``spec`` cannot travel in one launch line (too large, or text that is not Unicode), else None."""
    try:
        size = spec_bytes(spec)
    except UnicodeEncodeError:
        bad = [k for k, v in spec.items() if not _encodable(v)]
        return f"{', '.join(bad) or 'the spec'}: text must be valid Unicode (no lone surrogates)"
    if size <= MAX_SPEC_BYTES:
        return None
    sizes = sorted(((spec_bytes(v), k) for k, v in spec.items()), reverse=True)
    largest = ", ".join(f"{k} ({n} bytes)" for n, k in sizes[:2])
    return f"the spec is {size} bytes as JSON, over the {MAX_SPEC_BYTES} an agent accepts; largest: {largest}"


def program_problem(argv: list[str]) -> str | None:
    """Why ``argv[0]`` is not a program to exec (empty, or a whole shell command line), else None."""
    if not argv:
        return None
    program = argv[0]
    if not program.strip():
        return "command[0] must name a program"
    if any(c.isspace() for c in program):
        return (
            f"command[0] {program[:80]!r} is a shell command line, not a program: command is an argv list "
            "run without a shell; split it into items (['sh', '-c', '...'] when a shell is really meant)"
        )
    return None


def option_problem(arg: str) -> str | None:
    """Why a ``vllm_args`` item is refused (an option glued to its value by a space, e.g. a shell string)."""
    if not arg.startswith("-"):
        return None
    name = arg.partition("=")[0]
    if any(c.isspace() for c in name):
        return (
            f"vllm_args item {arg[:80]!r} holds several words: give each argument as its own item "
            "(['--dtype', 'float32'] or '--dtype=float32'); no shell splits them"
        )
    return None


def _encodable(value: Any) -> bool:
    try:
        spec_bytes(value)
    except UnicodeEncodeError:
        return False
    return True
