"""Protocol fuzzing against a real daemon: each bad line gets an error reply; the daemon keeps answering."""

from __future__ import annotations

import json
import random
import socket
from typing import Any

import pytest

from agent.protocol import MAX_LINE_BYTES
from tests.helpers.agentproc import AgentClient, AgentProc, agent_daemon

__all__ = ["agent_daemon"]

BAD_LINES: list[tuple[bytes, str]] = [
    (b"garbage", "bad_json"),
    (b"\xff\xfe\x00not utf-8", "bad_json"),
    (b"[1, 2, 3]", "not_an_object"),
    (b'"a string"', "not_an_object"),
    (b"null", "not_an_object"),
    (b"{}", "bad_args"),
    (b'{"op": 5}', "bad_args"),
    (b'{"id": [1], "op": "version"}', "bad_args"),
    (b'{"id": 1, "op": "rm -rf /"}', "unknown_op"),
    (b'{"id": 2, "op": "launch"}', "bad_args"),
    (b'{"id": 3, "op": "launch", "run": 5, "spec": {}}', "bad_args"),
    (b'{"id": 4, "op": "launch", "run": "x", "spec": []}', "bad_args"),
    (b'{"id": 5, "op": "status", "run": null}', "bad_args"),
    (b'{"id": 6, "op": "status", "run": "../../etc"}', "bad_args"),
    (b'{"id": 7, "op": "stop", "run": "none"}', "not_found"),
    (b'{"id": 8, "op": "read_log", "run": "none", "offset": -1}', "not_found"),
    (b'{"id": 9, "op": "follow", "run": "none", "after_seq": 0}', "not_found"),
    (b'{"id": 10, "op": "check", "path": 7}', "bad_args"),
    (b'{"id": 11, "op": "check", "path": "/no/such/file"}', "not_found"),
    (b'{"id": 12, "op": "check", "path": "/", "layers": true}', "bad_args"),
    (b'{"id": 13, "op": "stop", "run": "none", "grace_s": "soon"}', "not_found"),
    (b'{"id": 14, "op": "version", "extra": {"deep": [1, {"x": null}]}}', ""),
]


def _ask_version(c: AgentClient) -> None:
    assert c.result("version")["protocol"] == 1


@pytest.mark.parametrize(("line", "code"), BAD_LINES)
def test_bad_line_gets_error_and_connection_carries_on(
    agent_daemon: AgentProc, line: bytes, code: str
) -> None:
    with AgentClient(agent_daemon.socket) as c:
        c.send_raw(line + b"\n")
        msg = c.read_message(10)
        if code:
            assert msg["type"] == "error" and msg["code"] == code, msg
            assert msg["message"]
        else:
            assert msg["type"] == "reply"
        _ask_version(c)


def test_huge_line_is_discarded_without_killing_the_connection(agent_daemon: AgentProc) -> None:
    with AgentClient(agent_daemon.socket) as c:
        c.send_raw(b'{"id": 1, "op": "version", "pad": "' + b"x" * (10 << 20) + b'"}\n')
        msg = c.read_message(30)
        assert msg["type"] == "error" and msg["code"] == "too_long" and msg["id"] is None
        assert str(MAX_LINE_BYTES) in msg["message"]
        _ask_version(c)
        # Just under the limit is still accepted as a line (and then judged on its content).
        c.send_raw(b'{"id": 2, "op": "version", "pad": "' + b"y" * (MAX_LINE_BYTES - 100) + b'"}\n')
        assert c.read_message(30)["type"] == "reply"


def test_random_bytes_and_many_requests_in_one_write(agent_daemon: AgentProc) -> None:
    rng = random.Random(1234)
    with AgentClient(agent_daemon.socket) as c:
        blobs = [
            bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))).replace(b"\n", b"") or b"x"
            for _ in range(50)
        ]
        c.send_raw(b"\n".join(blobs) + b"\n")
        answers = [c.read_message(10) for _ in blobs]
        assert all(a["type"] in ("error", "reply") for a in answers)
        batch = b"".join(json.dumps({"id": i, "op": "version"}).encode() + b"\n" for i in range(200))
        c.send_raw(batch)
        ids = [c.read_message(10)["id"] for _ in range(200)]
        assert ids == list(range(200))


def test_blank_lines_are_ignored_and_abrupt_disconnects_are_survived(agent_daemon: AgentProc) -> None:
    for payload in (b"", b'{"id": 1, "op": "ver', b"\n\n\r\n", b'{"id": 1, "op": "list"}\n'):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(agent_daemon.socket))
        s.sendall(payload)
        s.close()
    with AgentClient(agent_daemon.socket) as c:
        c.send_raw(b"\n\n   \n")
        _ask_version(c)
        assert c.result("list") == {"runs": []}


def test_unterminated_last_request_is_answered_at_eof(agent_daemon: AgentProc) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(agent_daemon.socket))
    s.sendall(b'{"id": "last", "op": "version"}')
    s.shutdown(socket.SHUT_WR)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    s.close()
    msgs: list[dict[str, Any]] = [json.loads(x) for x in data.splitlines()]
    assert msgs[0]["type"] == "hello" and msgs[1]["id"] == "last" and msgs[1]["type"] == "reply"
