"""Adversarial inputs for output_dir (spec, JobSpec, launch rules), links out of the output dir, and a log
truncated, renamed and replaced at random while followed: fixed seeds, bounded loops, real files."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from pydantic import ValidationError

from agent.checks.checker import check_path
from agent.logs.generations import LogChain
from agent.logs.splitter import LineSplitter
from agent.runs.jobspec import JobSpec, SpecError
from agent.runs.outdir import launch_output_dir_error, output_dir_error
from agent.spec import parse_spec

# Blanks at the ends too: both views take paths as given.
PARTS = ["", ".", "..", "data", "hs", "...", "..a", "a..", "a b", " ", "a ", "run-1", "\x00", "~"]


def _random_path(rng: random.Random) -> str:
    parts = [rng.choice(PARTS) for _ in range(rng.randint(0, 5))]
    lead = rng.choice(["/", "//", "", "./"])
    return lead + "/".join(parts)


@pytest.mark.parametrize("seed", range(4))
def test_spec_and_jobspec_agree_on_every_output_dir(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(300):
        out = _random_path(rng)
        spec = {"host": "h", "model": "/m", "dataset": "/d", "output_dir": out}
        try:
            parse_spec(spec)
            pyd: str | None = None
        except ValidationError as e:
            pyd = " ".join(err["msg"] for err in e.errors())
        try:
            JobSpec.parse(spec)
            view: str | None = None
        except SpecError as e:
            view = str(e)
        if out == "":
            continue  # both read an empty output_dir as "not given"
        assert (pyd is None) == (view is None), (out, pyd, view)
        if view is not None:
            assert pyd is not None and view.removeprefix("spec.") in pyd
            parts = out.split("/")
            assert (
                ".." in parts
                or "\x00" in out
                or not out.startswith("/")
                or (os.path.normpath(out) in ("/", "//"))
            ), out
        else:
            assert ".." not in out.split("/") and os.path.normpath(out) not in ("/", "//")


@pytest.mark.parametrize("seed", range(3))
def test_launch_rules_refuse_every_overlap(seed: int, tmp_path: Path) -> None:
    rng = random.Random(seed)
    state = tmp_path / "state"
    (state / "runs" / "a").mkdir(parents=True)
    other = tmp_path / "other"
    other.mkdir()
    for i in range(60):
        pick = rng.choice(["state", "other", "fresh", "foreign", "own"])
        sub = "/".join(f"d{rng.randint(0, 3)}" for _ in range(rng.randint(0, 2)))
        if pick == "state":
            out = state / sub if sub else state
            assert "state directory" in str(launch_output_dir_error(str(out), str(state), []))
        elif pick == "other":
            out = other / sub if sub else other
            err = launch_output_dir_error(str(out), str(state), [("b", str(other))])
            assert "run 'b'" in str(err)
        else:
            out = tmp_path / f"{pick}{i}"
            out.mkdir()
            names = ["hs_3.safetensors", "manifest.json", ".staging-x", "hs_4.safetensors.lock"]
            if pick in ("own", "foreign"):
                for name in rng.sample(names, rng.randint(1, len(names))):
                    (out / name).touch()
            if pick == "foreign":
                (out / rng.choice(["notes.txt", "id_rsa", "hs_x.bin", ".bashrc"])).touch()
                assert "did not write" in str(launch_output_dir_error(str(out), str(state), []))
            else:
                assert launch_output_dir_error(str(out), str(state), [("b", str(other))]) is None
    assert output_dir_error("/") is not None and output_dir_error("/a/b") is None


@pytest.mark.parametrize("seed", range(3))
def test_no_link_out_of_the_output_dir_is_read(seed: int, tmp_path: Path) -> None:
    rng = random.Random(seed)
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"TOPSECRET" * 50)
    out = tmp_path / "out"
    (out / "inner").mkdir(parents=True)
    (out / "inner" / "ok.bin").write_bytes(b"\x00\x01")
    targets = [str(secret), "../secret.bin", "/etc/passwd", "inner/ok.bin", "missing", "hs_0.safetensors"]
    for i in range(20):
        os.symlink(rng.choice(targets), out / f"hs_{i}.safetensors")
    for target in (out, out / "hs_0.safetensors"):
        report = repr(check_path(target).to_dict())
        assert "TOPSECRET" not in report and "root:" not in report


def _write(fd: int, rng: random.Random, written: list[str], n: int) -> None:
    for _ in range(n):
        line = f"line {len(written)} " + "y" * rng.randint(0, 30)
        os.write(fd, (line + "\n").encode())
        written.append(line)


@pytest.mark.parametrize("seed", range(6))
def test_a_followed_log_loses_and_repeats_nothing_across_seams(seed: int, tmp_path: Path) -> None:
    rng = random.Random(seed)
    log = tmp_path / "output.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    chain = LogChain(log, [], lambda: None)
    splitter = LineSplitter()
    fed, got, written = 0, [], []  # type: ignore[var-annotated]
    rotated = 0

    def pump() -> None:
        nonlocal fed, splitter
        for _ in range(1000):
            data, seam = chain.poll(fed, 4096)
            if seam is not None:
                if seam != "moved":
                    got.extend(splitter.flush())
                    assert chain.current is not None
                    fed = chain.current.base
                    splitter = LineSplitter(start_offset=fed)
                continue
            if not data:
                return
            fed += len(data)
            got.extend(splitter.feed(data))

    try:
        for _ in range(40):
            _write(fd, rng, written, rng.randint(0, 20))
            pump()
            op = rng.choice(["write", "write", "truncate", "rename", "reopen"])
            if op == "truncate":
                os.ftruncate(fd, 0)
            elif op == "rename" and log.exists():
                rotated += 1
                os.rename(log, f"{log}.{rotated}")
            elif op == "reopen":
                rotated += 1
                if log.exists():
                    os.rename(log, f"{log}.{rotated}")
                os.close(fd)
                fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                _write(fd, rng, written, 1)  # a new file is only taken once it has something in it
            pump()
        pump()
        got.extend(splitter.flush())
    finally:
        os.close(fd)
        chain.close()
    assert [ln.text for ln in got] == written
    offsets = [ln.offset for ln in got]
    assert offsets == sorted(set(offsets))
    # a reader from any offset sees the same lines at the same offsets
    start = rng.choice(offsets) if offsets else 0
    reader = LineSplitter(start_offset=start)
    seen, pos = [], start
    chain2 = LogChain.restore(log, chain.snapshot(), lambda: None)
    try:
        for _ in range(10000):
            chunk = chain2.read_at(pos, 512)
            if chunk.jumped:
                seen.extend(reader.flush())
                reader, pos = LineSplitter(start_offset=chunk.offset), chunk.offset
            if not chunk.data:
                if chunk.at_end:
                    break
                continue
            pos += len(chunk.data)
            seen.extend(reader.feed(chunk.data))
        seen.extend(reader.flush())
    finally:
        chain2.close()
    by_offset = {ln.offset: ln.text for ln in got}
    for ln in seen:  # renamed-away files no longer reachable are skipped, never misread
        assert by_offset.get(ln.offset) == ln.text, ln
