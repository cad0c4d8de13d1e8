"""The JSON API in-process (httpx ASGI transport) over a real Controller and SQLite file."""

from __future__ import annotations

import httpx

from controller.service import Controller
from tests.web.conftest import csrf_of


async def test_health(client: httpx.AsyncClient) -> None:
    r = await client.get("/api/health")
    assert r.status_code == 200
    assert r.json()["ok"] is True and r.json()["version"]


async def test_hosts_crud_and_errors(client: httpx.AsyncClient) -> None:
    tok = await csrf_of(client)
    r = await client.post(
        "/api/hosts", json={"name": "gpu1", "ssh": "user@gpu1"}, headers={"x-csrf-token": tok}
    )
    assert r.status_code == 201, r.text
    assert r.json()["name"] == "gpu1" and r.json()["gpus"] == []
    assert [h["name"] for h in (await client.get("/api/hosts")).json()] == ["gpu1"]
    assert (await client.get("/api/hosts/gpu1")).json()["ssh"] == "user@gpu1"
    r = await client.get("/api/hosts/nope")
    assert r.status_code == 404 and r.json()["error"] == "not_found"
    r = await client.post("/api/hosts", json={"name": "gpu1", "ssh": "x"}, headers={"x-csrf-token": tok})
    assert r.status_code == 409 and r.json()["error"] == "conflict" and "gpu1" in r.json()["message"]
    assert [h["ssh"] for h in (await client.get("/api/hosts")).json()] == ["user@gpu1"]  # the first one kept
    r = await client.post(
        "/api/hosts", json={"name": "gpu2", "ssh": "-oProxyCommand=x"}, headers={"x-csrf-token": tok}
    )
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "ssh"


async def test_bad_spec_is_422_naming_the_field_and_launches_nothing(
    client: httpx.AsyncClient, ctl: Controller
) -> None:
    tok = await csrf_of(client)
    await client.post("/api/hosts", json={"name": "h1", "ssh": "h1"}, headers={"x-csrf-token": tok})
    cases = [
        ({"host": "h1", "backend": "command", "command": ["true"], "layers": [1, "x"]}, "layers.1"),
        (
            {"host": "h1", "backend": "command", "command": ["true"], "tensor_parallel_size": 0},
            "tensor_parallel_size",
        ),
        ({"host": "h1", "backend": "vllm-native", "model": "rel"}, "model"),
        ({"host": "h1", "backend": "command", "command": ["true"], "bogus": 1}, "bogus"),
    ]
    for spec, field in cases:
        r = await client.post("/api/runs", json=spec, headers={"x-csrf-token": tok})
        assert r.status_code == 422, r.text
        body = r.json()
        assert field in body["message"]
        assert any(e["field"] == field for e in body["errors"])
    r = await client.post(
        "/api/runs", json={"host": "h1", "backend": "command"}, headers={"x-csrf-token": tok}
    )
    assert r.status_code == 422 and "command" in r.json()["message"]
    assert (await client.get("/api/runs")).json() == []
    assert await ctl.list_runs() == []


async def test_unknown_host_is_a_bad_spec_naming_the_host_field(
    client: httpx.AsyncClient, ctl: Controller
) -> None:
    """A bad spec is 422 naming the field; an unconfigured host is one."""
    tok = await csrf_of(client)
    r = await client.post(
        "/api/runs",
        json={"host": "ghost", "backend": "command", "command": ["true"]},
        headers={"x-csrf-token": tok},
    )
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["error"] == "invalid" and "ghost" in body["message"]
    assert [e["field"] for e in body["errors"]] == ["host"]
    assert await ctl.list_runs() == []


async def test_unknown_run_and_alert_are_404_naming_them(client: httpx.AsyncClient) -> None:
    tok = await csrf_of(client)
    csrf = {"x-csrf-token": tok}
    for method, path, name in [
        ("GET", "/api/runs/nope", "nope"),
        ("POST", "/api/runs/nope/stop", "nope"),
        ("GET", "/api/runs/nope/events", "nope"),
        ("GET", "/api/runs/nope/log", "nope"),
        ("POST", "/api/alerts/12345/ack", "12345"),
        ("POST", "/api/alerts/12345/mute", "12345"),
    ]:
        r = await client.request(method, path, headers=csrf)
        assert r.status_code == 404, (path, r.text)
        assert r.json()["error"] == "not_found" and name in r.json()["message"], path


async def test_every_post_needs_the_csrf_token(client: httpx.AsyncClient) -> None:
    await csrf_of(client)
    for path, body in [("/api/hosts", {"name": "a", "ssh": "a"}), ("/api/runs", {}),
                       ("/api/runs/x/stop", None),
                       ("/api/alerts/1/ack", None)]:  # fmt: skip
        r = await client.post(path, json=body)
        assert r.status_code == 403 and "CSRF" in r.json()["message"], path
        r = await client.post(path, json=body, headers={"x-csrf-token": "wrong"})
        assert r.status_code == 403 and "CSRF" in r.json()["message"], path
    r = await client.post("/runs/new", data={"host": "a"})
    assert r.status_code == 403 and "CSRF" in r.text
    other = httpx.AsyncClient(transport=client._transport, base_url="http://127.0.0.1")  # another session
    tok = await csrf_of(client)
    r = await other.post("/api/hosts", json={"name": "a", "ssh": "a"}, headers={"x-csrf-token": tok})
    assert r.status_code == 403  # a token only works with the session it belongs to
    await other.aclose()
    assert (await client.get("/api/hosts")).json() == []  # and nothing was written
    assert (await client.get("/api/runs")).json() == []


async def test_host_and_origin_checks(client: httpx.AsyncClient) -> None:
    tok = await csrf_of(client)
    r = await client.get("/api/health", headers={"host": "attacker.example:8765"})
    assert r.status_code == 400 and r.json()["error"] == "bad_host"
    r = await client.post(
        "/api/hosts", json={"name": "a", "ssh": "a"},
        headers={"x-csrf-token": tok, "origin": "http://attacker.example"},
    )  # fmt: skip
    assert r.status_code == 403 and r.json()["error"] == "bad_origin"
    r = await client.post(
        "/api/hosts",
        json={"name": "a", "ssh": "a"},
        headers={"x-csrf-token": tok, "origin": "http://127.0.0.1"},
    )
    assert r.status_code == 201


async def test_security_headers_and_cookie(client: httpx.AsyncClient) -> None:
    r = await client.get("/")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp
    assert r.headers["x-content-type-options"] == "nosniff"
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie


async def test_metrics_prometheus_text(client: httpx.AsyncClient) -> None:
    tok = await csrf_of(client)
    await client.post("/api/hosts", json={"name": "h1", "ssh": "h1"}, headers={"x-csrf-token": tok})
    r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert 'eaglewatch_hosts{reachable="unknown"} 1.0' in r.text
    assert 'eaglewatch_runs{state="running"} 0.0' in r.text
    assert "eaglewatch_http_requests_total" in r.text


async def test_openapi_describes_every_endpoint(client: httpx.AsyncClient) -> None:
    doc = (await client.get("/openapi.json")).json()
    paths = doc["paths"]
    expected = {
        ("/api/health", "get"), ("/api/hosts", "get"), ("/api/hosts", "post"), ("/api/hosts/{name}", "get"),
        ("/api/runs", "post"), ("/api/runs", "get"), ("/api/runs/{run_id}", "get"),
        ("/api/runs/{run_id}/stop", "post"), ("/api/runs/{run_id}/events", "get"), ("/api/alerts", "get"),
        ("/metrics", "get"),
    }  # fmt: skip
    for path, method in expected:
        assert method in paths.get(path, {}), (path, method)
    ok = paths["/api/runs"]["post"]["responses"]
    assert "201" in ok and "422" in ok
    assert "$ref" in ok["201"]["content"]["application/json"]["schema"]
    assert "text/event-stream" in paths["/api/runs/{run_id}/events"]["get"]["responses"]["200"]["content"]
    assert "RunDetail" in doc["components"]["schemas"]
    assert "RunSpec" in doc["components"]["schemas"]


async def test_bad_or_unsafe_rules_are_422_naming_the_rule(
    client: httpx.AsyncClient, ctl: Controller
) -> None:
    tok = await csrf_of(client)
    await client.post("/api/hosts", json={"name": "h1", "ssh": "h1"}, headers={"x-csrf-token": tok})
    cases = [
        ({"name": "slow", "kind": "progress", "regex": "(a+)+$"}, "quantified group holds a quantifier"),
        ({"name": "alt", "kind": "progress", "regex": "(a|ab)*c"}, "alternation"),
        ({"name": "poly", "kind": "progress", "regex": r"\d+\d+x"}, "two quantifiers in a row"),
        ({"name": "paren", "kind": "progress", "regex": "("}, "does not compile"),
        ({"name": "nokind", "regex": "x"}, "field 'kind': missing"),
        ({"name": "long", "kind": "progress", "regex": "x" * 301}, "at most 300"),
    ]
    for rule, words in cases:
        spec = {"host": "h1", "backend": "command", "command": ["true"], "rules": [rule]}
        r = await client.post("/api/runs", json=spec, headers={"x-csrf-token": tok})
        assert r.status_code == 422, r.text
        message = r.json()["message"]
        assert f"rule[0] {rule['name']!r}" in message and words in message, message
    assert await ctl.list_runs() == []
