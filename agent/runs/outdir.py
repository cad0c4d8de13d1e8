"""Where a run may write: the output_dir rules shared by the spec (pydantic), JobSpec and the daemon's launch,
and whose capture a directory holds.

``output_dir_error`` is pure (the path's text alone); ``launch_output_dir_error`` looks at the host.  A
directory is acceptable when it is missing, empty, or holds only what an extraction writes (the run resumes
it), and then only when its ownership record (``OWNER_FILE``) names the same ``Capture``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import PurePosixPath
from typing import Any

#: What an extraction (or a capture command) leaves in its output dir: resuming into it is fine.
OWN_FILE = re.compile(
    r"^(?:hs_\d+\.safetensors(?:\.zst)?(?:\.lock|\.\d+\.tmp)?"
    r"|data_\d+\.(?:pt|ckpt|ckpt\.gz)(?:\.lock)?"
    r"|manifest[^/]*\.json"
    r"|sample_lengths\.json"
    r"|layer_stats\.jsonl"
    r"|\.staging-[^/]*"
    r"|rows_\d+-\d+|vocab_mapping"  # SpecForge's group folders and its vocabulary mapping
    r"|\.eaglewatch-owner\.json"
    r"|\.(?:hs_\d+\.safetensors|manifest[^/]*\.json|eaglewatch-owner\.json)[^/]*\.tmp)$"
)
#: The ownership record: which capture the directory's files belong to.
OWNER_FILE = ".eaglewatch-owner.json"
#: The files a capture's identity is checked for before a run may write beside them.
CAPTURE_FILE = re.compile(r"^hs_\d+\.safetensors(?:\.zst)?$")
#: Manifests an older version left (the merged one first, then a shard's): read when there is no record.
MANIFEST_FILE = re.compile(r"^manifest(?:\.shard-\d+-of-\d+)?\.json$")


def output_dir_error(value: str) -> str | None:
    """Why ``value`` cannot be an output dir from its text alone (None when it can)."""
    if "\x00" in value or not PurePosixPath(value).is_absolute():
        return f"output_dir must be an absolute path on the host, got {value[:200]!r}"
    if ".." in PurePosixPath(value).parts:
        return f"output_dir must not contain '..', got {value[:200]!r}"
    if os.path.normpath(value) in ("/", "//"):
        return "output_dir must not be the root directory '/'"
    return None


def _within(path: str, root: str) -> bool:
    """True when ``path`` is ``root`` or lies under it (both resolved)."""
    return path == root or path.startswith(root.rstrip("/") + "/")


def overlap(a: str, b: str) -> bool:
    """True when output dirs ``a`` and ``b`` (absolute, as written) are one directory or one holds the
    other."""
    a, b = os.path.normpath(a), os.path.normpath(b)
    return _within(a, b) or _within(b, a)


def foreign_files(out: str) -> list[str]:
    """Names in ``out`` that an extraction does not write (empty when ``out`` is missing or not readable)."""
    try:
        names = sorted(os.listdir(out))
    except OSError:
        return []
    return [n for n in names if OWN_FILE.match(n) is None]


def launch_output_dir_error(
    value: str, state_dir: str, other_runs: Iterable[tuple[str, str]], wanted: Capture | None = None
) -> str | None:
    """Why a launch must refuse ``value`` as output_dir on this host; ``other_runs`` is (run, output_dir) of
    the runs that hold theirs; ``wanted``: the capture the run asks for (None: a run that captures nothing
    of ours, or one whose capture only its job can tell)."""
    err = output_dir_error(value)
    if err is not None:
        return err
    out = os.path.realpath(value)
    state = os.path.realpath(state_dir)
    if _within(out, state) or _within(state, out):
        return f"output_dir {value[:200]!r} overlaps the agent's state directory {state_dir!r}"
    for run, other in other_runs:
        if other and overlap(out, os.path.realpath(other)):
            return f"output_dir {value[:200]!r} overlaps the output directory of run {run!r}"
    if os.path.lexists(value) and not os.path.isdir(value):
        return f"output_dir {value[:200]!r} exists and is not a directory"
    foreign = foreign_files(value)
    if foreign:
        shown = ", ".join(repr(n[:80]) for n in foreign[:5])
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        return (
            f"output_dir {value[:200]!r} holds files the run did not write ({shown}{more}); "
            "use an empty or new directory, or the output dir of the run being resumed"
        )
    return capture_error(value, wanted) if wanted is not None else None


@dataclass(frozen=True)
class Capture:
    """What a capture is: files of two captures that differ in any of these must never share a directory."""

    layers: tuple[int, ...]
    layer_convention: str
    model: str
    model_config_sha256: str
    dtype: str
    backend: str

    @classmethod
    def from_doc(cls, doc: Any) -> Capture | None:
        """The capture a record or a manifest (its ``layer_ids``) states; None when it states none."""
        if not isinstance(doc, dict):
            return None
        layers = doc.get("layers", doc.get("layer_ids"))
        text = [doc.get(k) for k in ("layer_convention", "model", "model_config_sha256", "dtype", "backend")]
        if not isinstance(layers, list) or not all(type(i) is int for i in layers):
            return None
        if not all(isinstance(t, str) for t in text):
            return None
        convention, model, sha, dtype, backend = (str(t) for t in text)
        return cls(tuple(layers), convention, os.path.normpath(model), sha, dtype, backend)

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON values (what the job's ``--capture`` prints; the record adds the run id)."""
        return {**asdict(self), "layers": list(self.layers)}


def _shown(value: Any) -> str:
    return str(list(value)) if isinstance(value, tuple) else str(value)


def holds_capture(out: str) -> bool:
    """True when ``out`` holds capture files (hs_N.safetensors[.zst]): a run writing there mixes with them."""
    try:
        return any(CAPTURE_FILE.match(n) for n in os.listdir(out))
    except OSError:
        return False


def held_capture(out: str) -> tuple[Capture | None, str]:
    """The capture ``out`` holds and where that was read: its ownership record, else a manifest an older
    version left; (None, why) when neither says."""
    try:
        names = sorted(os.listdir(out), key=lambda n: (n != "manifest.json", n))
    except OSError as exc:
        return None, f"cannot list it: {exc.strerror}"
    sources = ([OWNER_FILE] if OWNER_FILE in names else []) + [n for n in names if MANIFEST_FILE.match(n)]
    for name in sources:
        try:
            with open(os.path.join(out, name), encoding="utf-8") as fh:
                capture = Capture.from_doc(json.load(fh))
        except (OSError, ValueError):
            capture = None
        if capture is not None:
            return capture, name
        if name == OWNER_FILE:  # a damaged record is not overruled by a manifest
            return None, f"{OWNER_FILE} cannot be read"
    return None, f"no {OWNER_FILE} and no manifest.json that names its layers"


def capture_error(value: str, wanted: Capture) -> str | None:
    """Why a run capturing ``wanted`` must not write into ``value`` (None when it holds no capture files or
    the same capture: the run then resumes it)."""
    if not holds_capture(value):
        return None
    held, source = held_capture(value)
    if held is None:
        return (
            f"output_dir {value[:200]!r} holds capture files but nothing says what they capture ({source}): "
            "choose another output_dir"
        )
    diffs = [(f.name, getattr(held, f.name), getattr(wanted, f.name)) for f in fields(held)]
    diffs = [(name, old, new) for name, old, new in diffs if old != new]
    if not diffs:
        return None
    have = " and ".join(f"{name} {_shown(old)}" for name, old, _ in diffs)
    want = " and ".join(f"{name} {_shown(new)}" for name, _, new in diffs)
    return (
        f"output_dir {value[:200]!r} holds a capture of {have}; this spec asks for {want}: "
        "choose another output_dir"
    )


def write_owner(out: str, run: str, capture: Capture) -> None:
    """Write ``out``'s ownership record atomically (a reader sees the old record or the new one)."""
    path = os.path.join(out, OWNER_FILE)
    tmp = os.path.join(out, f"{OWNER_FILE}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump({"run": run, **capture.to_dict()}, fh)
        fh.write("\n")
    os.replace(tmp, path)
