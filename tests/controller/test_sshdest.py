"""SSH destination parsing, as a table."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from controller.models import HostCreate, parse_destination


@pytest.mark.parametrize(
    ("dest", "expected"),
    [
        ("gpu-box", ("gpu-box", None, None)),
        ("alice@gpu-box", ("gpu-box", None, "alice")),
        ("alice@10.0.0.5:2222", ("10.0.0.5", 2222, "alice")),
        ("ssh://bob@host.example:22", ("host.example", 22, "bob")),
        ("[::1]:2200", ("::1", 2200, None)),
        ("carol@[fe80::1]", ("fe80::1", None, "carol")),
    ],
)
def test_parse(dest: str, expected: tuple[str, int | None, str | None]) -> None:
    assert parse_destination(dest) == expected


@pytest.mark.parametrize("dest", ["host:notaport", "host:0", "host:70000", "alice@", ":22"])
def test_rejected(dest: str) -> None:
    with pytest.raises(ValueError, match="ssh destination"):
        parse_destination(dest)


@pytest.mark.parametrize("dest", ["-oProxyCommand=x", "a b", "host:99999", "x\x00"])
def test_host_create_rejects(dest: str) -> None:
    with pytest.raises(ValidationError, match="ssh"):
        HostCreate(name="h", ssh=dest)


@pytest.mark.parametrize(
    ("version", "than", "older"),
    [
        ("0.0.9", "0.1.0", True),
        ("0.1.0", "0.1.0", False),
        ("0.2.0", "0.1.0", False),
        ("0.10.0", "0.9.1", False),
        ("", "0.1.0", True),
        ("0.1.0rc1", "0.1.1", True),
    ],
)
def test_is_older(version: str, than: str, older: bool) -> None:
    from controller.bootstrap import is_older

    assert is_older(version, than) is older
