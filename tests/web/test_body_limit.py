"""Request bodies are bounded (413 before the body is read) and run specs are strict and bounded (422)."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from agent import limits
from controller.service import Controller
from tests.web.conftest import csrf_of, start_server


def test_declared_body_over_the_limit_is_413_without_reading_it(tmp_path: Path) -> None:
    """A real uvicorn: the client declares 50 MB and sends one byte; the answer comes at once."""
    srv = start_server(tmp_path / "home", supervise=False)
    try:
        port = int(srv.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(
                b"POST /api/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: 50000000\r\n\r\n{"
            )
            head = sock.recv(65536)
        assert head.startswith(b"HTTP/1.1 413"), head[:200]
        assert b"too_large" in head and str(limits.MAX_BODY_BYTES).encode() in head
    finally:
        srv.stop()


async def test_a_50_mb_env_value_is_413_up_front(client: httpx.AsyncClient, ctl: Controller) -> None:
    tok = await csrf_of(client)
    spec = {"host": "h1", "backend": "command", "command": ["true"], "env": {"A": "x" * 50_000_000}}
    r = await client.post("/api/runs", json=spec, headers={"x-csrf-token": tok})
    assert r.status_code == 413 and r.json()["error"] == "too_large"
    assert await ctl.list_runs() == []


async def test_a_chunked_body_over_the_limit_is_413(client: httpx.AsyncClient) -> None:
    """No Content-Length: the middleware stops reading once past the limit."""

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(40):
            yield b" " * 65536

    tok = await csrf_of(client)
    r = await client.post(
        "/api/runs", content=chunks(), headers={"x-csrf-token": tok, "content-type": "application/json"}
    )
    assert r.status_code == 413 and r.json()["error"] == "too_large"


async def test_a_body_at_the_limit_reaches_validation(client: httpx.AsyncClient) -> None:
    tok = await csrf_of(client)
    body = b'{"host": "ghost", "backend": "command", "command": ["true"]}'
    body = body[:-1] + b" " * (limits.MAX_BODY_BYTES - len(body)) + b"}"
    r = await client.post(
        "/api/runs", content=body, headers={"x-csrf-token": tok, "content-type": "application/json"}
    )
    assert r.status_code == 422 and "ghost" in r.json()["message"]


async def test_spec_fields_are_strict_and_bounded_through_the_api(
    client: httpx.AsyncClient, ctl: Controller
) -> None:
    tok = await csrf_of(client)
    await client.post("/api/hosts", json={"name": "h1", "ssh": "h1"}, headers={"x-csrf-token": tok})
    base = {"host": "h1", "backend": "command", "command": ["true"]}
    cases = [
        ({"tensor_parallel_size": "8"}, "tensor_parallel_size"),
        ({"tensor_parallel_size": True}, "tensor_parallel_size"),
        ({"max_samples": 2**64}, "max_samples"),
        ({"layers": [2**63]}, "layers"),
        ({"env": {"A": "x" * (limits.MAX_ENV_VALUE_CHARS + 1)}}, "env.A"),
        ({"vllm_args": ["--x"] * (limits.MAX_ARGS + 1)}, "vllm_args"),
        ({"command": ["sh -c 'rm -rf ~/x'"]}, "command"),
        ({"vllm_args": ["--dtype float32; rm -rf /"]}, "vllm_args"),
    ]
    for change, field in cases:
        r = await client.post("/api/runs", json={**base, **change}, headers={"x-csrf-token": tok})
        assert r.status_code == 422, (change, r.text)
        assert any(e["field"] == field for e in r.json()["errors"]), (field, r.json())
    assert await ctl.list_runs() == []
