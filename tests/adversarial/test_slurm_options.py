"""Extra sbatch options cannot reach what eaglewatch sets: abbreviations resolved as sbatch does."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from agent.sched.options import SBATCH_LONG_OPTIONS, SlurmOptions, resolve_long, sbatch_arg_problem


@pytest.mark.parametrize(
    ("arg", "means"),
    [
        ("--outp=/tmp/x", "--output"),
        ("--err=/tmp/x", "--error"),
        ("--arr=0-9", "--array"),
        ("--ar=1", "--array"),
        ("--chd=/", "--chdir"),
        ("--open-m=truncate", "--open-mode"),
        ("--job-na=renamed", "--job-name"),
        ("--j=renamed", "--job-name"),
        ("--pars", "--parsable"),
        ("--wr=id", "--wrap"),
    ],
)
def test_an_abbreviated_reserved_option_is_refused_and_named(arg: str, means: str) -> None:
    problem = sbatch_arg_problem(arg) or ""
    name = arg.split("=", 1)[0]
    assert f"{name} abbreviates {means}, which is set by eaglewatch" in problem, problem


@pytest.mark.parametrize("arg", ["--wait", "--test", "--test-o", "--help", "--usa", "--vers"])
def test_an_option_that_keeps_sbatch_from_printing_a_job_id_is_refused(arg: str) -> None:
    assert "printing its id" in (sbatch_arg_problem(arg) or "")


@pytest.mark.parametrize(
    ("arg", "candidate"),
    [("--o=/tmp/x", "--output"), ("--e=/tmp/x", "--error"), ("--pa=x", "--parsable"), ("--w", "--wrap")],
)
def test_an_ambiguous_prefix_is_refused_with_its_candidates(arg: str, candidate: str) -> None:
    problem = sbatch_arg_problem(arg) or ""
    assert "ambiguous" in problem and candidate in problem, problem


@pytest.mark.parametrize(
    "arg",
    [
        "--part=gpu",
        "--mem=0",
        "--exclusive",
        "--qos=high",
        "--time-min=5",
        "--cluster=a",
        "--tres-per-task=gpu:1",
    ],
)
def test_other_options_pass(arg: str) -> None:
    assert sbatch_arg_problem(arg) is None


@pytest.mark.parametrize(
    "arg", ["-o", "-o/tmp/x", "-e/tmp/x", "-a1", "-D/", "-Jx", "--output", "--comment=a\nb"]
)
def test_short_forms_exact_names_and_newlines_are_refused(arg: str) -> None:
    assert sbatch_arg_problem(arg) is not None


@pytest.mark.parametrize("name", ["debug\n", "debug\r\n", "\ndebug", "de bug"])
def test_a_partition_name_is_matched_whole(name: str) -> None:
    with pytest.raises(ValueError, match=r"scheduler\.partition"):
        SlurmOptions.parse({"kind": "slurm", "partition": name})
    with pytest.raises(ValueError, match=r"scheduler\.account"):
        SlurmOptions.parse({"kind": "slurm", "account": name})


def test_resolution_follows_getopt() -> None:
    assert resolve_long("bb") == ("bb",)  # an exact name wins over the longer --bbf
    assert resolve_long("clusters") == ("clusters",)
    assert resolve_long("outp") == ("output",)
    assert resolve_long("zzz") == ()
    assert set(resolve_long("o")) == {"open-mode", "output", "overcommit", "oversubscribe"}


def _sbatch_verdict(sbatch: str, conf: Path, prefix: str) -> tuple[str, ...] | None:
    """What sbatch's getopt makes of --prefix: the candidates when ambiguous, () unknown, None resolved."""
    out = subprocess.run(
        [sbatch, f"--{prefix}=1", "/dev/null"],
        env={"SLURM_CONF": str(conf), "PATH": "/usr/bin:/bin"},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
    )
    text = out.stdout + out.stderr
    if "is ambiguous" in text:
        return tuple(sorted(re.findall(r"'--([a-z-]+)'", text.split("possibilities:", 1)[1])))
    if "unrecognized option" in text:
        return ()
    return None


def test_the_embedded_list_matches_the_installed_sbatch(tmp_path: Path) -> None:
    """Ask the real sbatch's getopt (it parses before it needs a controller) what each prefix means."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        pytest.skip("sbatch is not installed")
    conf = tmp_path / "slurm.conf"
    conf.write_text(
        "ClusterName=probe\nSlurmctldHost=localhost\nNodeName=localhost CPUs=1 State=UNKNOWN\n"
        "PartitionName=p Nodes=localhost Default=YES\n"
    )
    reserved = ("output", "error", "array", "parsable", "chdir", "wrap", "job-name", "open-mode")
    prefixes = {chr(c) for c in range(ord("a"), ord("z") + 1)}
    prefixes |= {r[:i] for r in reserved for i in range(1, len(r) + 1)}
    for prefix in sorted(prefixes):
        ours = resolve_long(prefix)
        want = None if len(ours) == 1 else tuple(sorted(ours))
        assert _sbatch_verdict(sbatch, conf, prefix) == want, prefix
    for name in SBATCH_LONG_OPTIONS:  # every embedded name is one sbatch knows
        assert _sbatch_verdict(sbatch, conf, name) is None, name
