"""Case tables for the wire protocol's pure functions (agent/protocol.py): no daemon, no socket."""

from __future__ import annotations

from typing import Any

import pytest

from agent import protocol
from agent.protocol import (
    MAX_LINE_BYTES,
    ErrorCode,
    Op,
    ProtocolError,
    Request,
    decode_message,
    decode_request,
)

GOOD_REQUESTS: list[tuple[bytes | str, Request]] = [
    (b'{"id": 1, "op": "version"}', Request(1, Op.VERSION, {})),
    ('{"id": "a", "op": "list"}\n', Request("a", Op.LIST, {})),
    (b'{"op": "gpus"}', Request(None, Op.GPUS, {})),
    (b'{"id": 2, "op": "status", "run": "r1"}', Request(2, Op.STATUS, {"run": "r1"})),
    (
        b'{"id": 3, "op": "launch", "run": "r1", "spec": {"backend": "command"}}',
        Request(3, Op.LAUNCH, {"run": "r1", "spec": {"backend": "command"}}),
    ),
    (
        b'{"id": 4, "op": "follow", "run": "r1", "after_seq": 7, "log_offset": null}',
        Request(4, Op.FOLLOW, {"run": "r1", "after_seq": 7, "log_offset": None}),
    ),
    (
        '{"id": 5, "op": "check", "path": "/o/hs_0.safetensors"}',
        Request(5, Op.CHECK, {"path": "/o/hs_0.safetensors"}),
    ),
    ('{"id": 6, "op": "read_log", "run": "é"}'.encode(), Request(6, Op.READ_LOG, {"run": "é"})),
]


@pytest.mark.parametrize(("line", "expected"), GOOD_REQUESTS)
def test_decode_request_accepts(line: bytes | str, expected: Request) -> None:
    assert decode_request(line) == expected


BAD_REQUESTS: list[tuple[bytes | str, ErrorCode, Any, str]] = [
    # line, code, the id the error reply carries, a word the message must hold
    (b"garbage", ErrorCode.BAD_JSON, None, "not JSON"),
    (b"\xff\xfe", ErrorCode.BAD_JSON, None, "UTF-8"),
    (b"", ErrorCode.BAD_JSON, None, "not JSON"),
    (b"[1, 2]", ErrorCode.NOT_AN_OBJECT, None, "list"),
    (b"null", ErrorCode.NOT_AN_OBJECT, None, "NoneType"),
    (b'"op"', ErrorCode.NOT_AN_OBJECT, None, "str"),
    (b'{"id": [1], "op": "version"}', ErrorCode.BAD_ARGS, None, "'id'"),
    (b'{"id": 1.5, "op": "version"}', ErrorCode.BAD_ARGS, None, "'id'"),
    (b'{"id": 1}', ErrorCode.BAD_ARGS, 1, "'op'"),
    (b'{"id": 2, "op": 5}', ErrorCode.BAD_ARGS, 2, "'op'"),
    (b'{"id": 3, "op": "rm -rf /"}', ErrorCode.UNKNOWN_OP, 3, "rm -rf"),
    (b'{"id": 4, "op": "VERSION"}', ErrorCode.UNKNOWN_OP, 4, "known: version"),
    (b'{"id": 5, "op": "launch"}', ErrorCode.BAD_ARGS, 5, "run, spec"),
    (b'{"id": 6, "op": "launch", "run": "r"}', ErrorCode.BAD_ARGS, 6, "spec"),
    (b'{"id": "s", "op": "stop"}', ErrorCode.BAD_ARGS, "s", "run"),
    (b'{"id": 7, "op": "check"}', ErrorCode.BAD_ARGS, 7, "path"),
    (b'{"id": 8, "op": "' + b"x" * MAX_LINE_BYTES + b'"}', ErrorCode.TOO_LONG, None, "exceeds"),
]


@pytest.mark.parametrize(("line", "code", "request_id", "word"), BAD_REQUESTS)
def test_decode_request_refuses(line: bytes | str, code: ErrorCode, request_id: Any, word: str) -> None:
    with pytest.raises(ProtocolError) as err:
        decode_request(line)
    assert (err.value.code, err.value.request_id) == (code, request_id)
    assert word in err.value.message


GOOD_MESSAGES: list[tuple[bytes | str, dict[str, Any]]] = [
    (protocol.encode(protocol.hello("0.1.0", "gpu1", 7, "/s")), protocol.hello("0.1.0", "gpu1", 7, "/s")),
    (
        protocol.encode(protocol.reply(1, {"runs": []})),
        {"type": "reply", "id": 1, "ok": True, "result": {"runs": []}},
    ),
    (
        protocol.encode(protocol.error(None, ErrorCode.TOO_LONG, "long")),
        {"type": "error", "id": None, "code": "too_long", "message": "long"},
    ),
    (
        '{"type": "event", "run": "r", "event": {"seq": 1}}',
        {"type": "event", "run": "r", "event": {"seq": 1}},
    ),
    (
        '{"type": "future_kind", "x": 1}',
        {"type": "future_kind", "x": 1},
    ),  # unknown types are the caller's call
]


@pytest.mark.parametrize(("line", "expected"), GOOD_MESSAGES)
def test_decode_message_reads_what_encode_writes(line: bytes | str, expected: dict[str, Any]) -> None:
    assert decode_message(line) == expected


BAD_MESSAGES: list[tuple[bytes | str, ErrorCode]] = [
    (b"not json", ErrorCode.BAD_JSON),
    (b"\xff\xfe{}", ErrorCode.BAD_JSON),
    (b"", ErrorCode.BAD_JSON),
    (b"[]", ErrorCode.NOT_AN_OBJECT),
    (b"{}", ErrorCode.NOT_AN_OBJECT),
    (b'{"type": 1}', ErrorCode.NOT_AN_OBJECT),
    (b'{"type": null, "id": 1}', ErrorCode.NOT_AN_OBJECT),
]


@pytest.mark.parametrize(("line", "code"), BAD_MESSAGES)
def test_decode_message_refuses(line: bytes | str, code: ErrorCode) -> None:
    with pytest.raises(ProtocolError) as err:
        decode_message(line)
    assert err.value.code == code and err.value.message.startswith("daemon sent")


def test_encode_is_one_compact_utf8_line() -> None:
    line = protocol.encode({"type": "event", "run": "r", "event": {"text": "é\nx"}})
    assert line.endswith(b"\n") and line.count(b"\n") == 1  # the newline inside is escaped
    assert "é".encode() in line and b", " not in line
