"""Build the vLLM wheelhouse that carries vLLM to the lent H200 machines (runs HERE, on a CPU machine).

    python tests/gpu/wheelhouse.py [--out .gpuwh] [--part-mib 60] [--vllm 0.26.0] [--download-dir DIR]
                                   [--compress auto|none|xz|zstd]

The H200 image (Python 3.12, torch 2.11.0 for CUDA 13) has no network, no vLLM and no pydantic/fastapi/pyzmq.
This script (stdlib + pip only):

1. downloads (or reuses, from --download-dir) the vLLM wheel and the pinned runtime wheels the image
   lacks (``PINS``: cp312 manylinux x86_64 wheels), checks the pins against vLLM's own Requires-Dist, and
   prints every non-extra requirement of every wheel that is neither in the image (``IMAGE_PACKAGES``) nor
   in the wheelhouse;
2. rewrites the vLLM wheel without the members a Hopper run never loads (FA2 kernels, the Rust
   ``vllm-rs`` frontend binary, the C++ headers under ``vllm/third_party/``), with a RECORD to match
   (see ``hopper_drop``);
3. packs the wheels into one deterministic tar, measures whether xz on the whole tar saves a part (the
   wheels are then re-zipped *stored*, so xz sees raw bytes: FA3's kernels shrink from 38 to 8 MB; it saves
   one: 3 parts -> 2), and splits the result into ``OUT/part1/<payload>.part1``, ``OUT/part2/...`` (each
   <= --part-mib MiB) with ``OUT/part1/MANIFEST.json`` (part names, sizes, sha256s, the total sha256 and
   the wheel list).

Reruns reuse downloads, rewritten wheels and compressed payloads (``OUT/build/cache.json``).
``tests/gpu/install_wheelhouse.sh`` stashes the parts on the machine, one call each, and installs them;
it calls ``python3 tests/gpu/wheelhouse.py unpack DIR`` there (verify every part, join, untar).
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VLLM_VERSION = "0.26.0"

# Runtime packages `from vllm import LLM`, the engine, the worker, the Llama/DeepSeek-V2 models and the
# hidden-states connector import that the H200 image lacks (found by importing them in a scratch venv),
# pinned for vLLM 0.26.0 to the newest releases that satisfy vLLM's own Requires-Dist *and* each other's:
# apache-tvm-ffi==0.1.10 is vLLM's exact pin, so xgrammar stays at 0.2.7 (0.2.8 and later require
# apache-tvm-ffi>=0.1.11); llguidance stays on 1.7.x (vLLM: <1.8.0); openai 3.x needs httpx2, which needs
# httpcore2 and truststore.
PINS: dict[str, str] = {
    "annotated-types": "0.8.0",
    "apache-tvm-ffi": "0.1.10",
    "cachetools": "8.0.2",
    "cbor2": "6.3.0",
    "fastapi": "0.136.3",
    "httpcore2": "2.16.2",
    "httpx2": "2.16.2",
    "jiter": "0.19.0",
    "llguidance": "1.7.6",
    "msgspec": "0.23.0",
    "openai": "3.57.0",
    "openai-harmony": "0.0.8",
    "opentelemetry-api": "1.45.2",
    "partial-json-parser": "0.2.1.1.post7",
    "pybase64": "1.5.1",
    "pydantic": "2.14.4",
    "pydantic-core": "2.50.5",
    "pyzmq": "27.3.0",
    "sniffio": "1.3.1",
    "starlette": "1.10.0",
    "truststore": "0.10.5",
    "typing-inspection": "0.4.5",
    "xgrammar": "0.2.7",
}

# The packages already on the H200 image, as the machines' description listed them on 2026-11-17.
IMAGE_PACKAGES: frozenset[str] = frozenset(
    """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch
grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig
interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime
onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint
packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache
protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect
urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split()  # noqa: SIM905
)
# The image's versions as that description and docs/gpu.md give them; any other one is unknown here.
IMAGE_VERSIONS: dict[str, str] = {
    "accelerate": "1.15.0",
    "cupy-cuda13x": "14.2.0",
    "huggingface-hub": "1.33.0",
    "numpy": "2.5.2",
    "safetensors": "0.8.0",
    "sentencepiece": "0.2.2",
    "tiktoken": "0.14.0",
    "tokenizers": "0.23.2",
    "torch": "2.11.0",
    "torchaudio": "2.11.0",
    "torchvision": "0.26.0",
    "transformers": "5.17.0",
    "triton": "3.6.0",
}
# Environment markers of the machine's python3 (3.12.3, Linux x86_64); "extra" empty = non-extra requirements.
MARKER_ENV: dict[str, str] = {
    "implementation_name": "cpython",
    "implementation_version": "3.12.3",
    "os_name": "posix",
    "platform_machine": "x86_64",
    "platform_python_implementation": "CPython",
    "platform_release": "",
    "platform_system": "Linux",
    "platform_version": "",
    "python_full_version": "3.12.3",
    "python_version": "3.12",
    "sys_platform": "linux",
    "extra": "",
}
# pip matches manylinux_2_N exactly: list them all (llguidance 1.7.x is tagged manylinux_2_31 only; with fewer
# tags pip reports 1.6.1 as the newest).
PLATFORMS: tuple[str, ...] = (
    *(f"manylinux_2_{n}_x86_64" for n in range(17, 40)),
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)

# ---- what the slim vLLM wheel leaves out (checked against the vLLM 0.26.0 wheel's own sources) ----------
# Why each dropped member is safe on an H200 (read in the vLLM 0.26.0 wheel's own sources):
# - FA2, vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so (305 MB; 129 MB packed): flash_attn_interface.py imports it
#   inside try/except and only records FA2 as unavailable; vllm_flash_attn/__init__.py raises only when FA2
#   and FA3 are both missing; v1/attention/backends/fa_utils.py get_flash_attn_version() picks FA3 on compute
#   capability 9 (Hopper). Every _vllm_fa2_C op sits behind `fa_version == 2`. Still FA2 on an H200 (and so an
#   assertion without it): ALiBi models and an explicit attention_config.flash_attn_version=2.
# - vllm/vllm-rs (43 MB): an ELF executable, the Rust HTTP frontend `vllm serve` starts only when
#   VLLM_USE_RUST_FRONTEND=1 (envs.py, _resolve_rust_frontend_path, returns None otherwise).
# - C++ headers under vllm/third_party/ (*.h, *.hpp, *.inl, *.cuh: 1764 files, 54 MB, 7.2 MB packed; the .py,
#   .so and .cu members there stay): never imported, read only by JIT compilers (DeepGEMM's nvcc JIT for FP8
#   block-scaled GEMMs; fmha_sm100, SM100 only). utils/deep_gemm.py already treats a failed vendored
#   DeepGEMM init as "not available" with a warning. bf16 runs never call DeepGEMM; FP8 block-quantized
#   models on this wheel need VLLM_USE_DEEP_GEMM=0.
FA2_MEMBER = "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"
RUST_FRONTEND_MEMBER = "vllm/vllm-rs"
THIRD_PARTY = "vllm/third_party/"
HEADER_SUFFIXES: tuple[str, ...] = (".h", ".hpp", ".inl", ".cuh")
# Part of the cache key of a slim wheel: a change of the rules rebuilds it.
DROP_RULES = hashlib.sha256(
    repr((FA2_MEMBER, RUST_FRONTEND_MEMBER, THIRD_PARTY, HEADER_SUFFIXES)).encode()
).hexdigest()[:12]
# A wheel's RECORD signatures no longer match once RECORD changes (the vLLM wheel has none).
RECORD_SIGNATURES: tuple[str, ...] = ("RECORD.jws", "RECORD.p7s")

MIB = 1 << 20
MANIFEST = "MANIFEST.json"
TAR_NAME = "wheelhouse.tar"
CACHE = "cache.json"
# Codecs: xz is undone on the machine by Python's own lzma (no binary needed there); zstd needs a `zstd`
# binary there (not checked), so only --compress zstd builds it.
CODEC_SUFFIX: dict[str, str] = {"none": "", "xz": ".xz", "zstd": ".zst"}
XZ_ARGS: tuple[str, ...] = ("-9", "-T0")  # -9: 64 MiB dictionary; -6 (8 MiB) misses FA3's long repeats
ZSTD_ARGS: tuple[str, ...] = ("-19", "--long=27", "-T0")


class PartError(RuntimeError):
    """A wheelhouse part is missing, has the wrong size or the wrong sha256."""


# ---- wheels ------------------------------------------------------------------------------------------------


def record_hash(data: bytes) -> str:
    """The RECORD hash of ``data``: ``sha256=`` + urlsafe base64 without padding (PEP 376/427)."""
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def record_name(names: Iterable[str]) -> str:
    """The ``*.dist-info/RECORD`` member among a wheel's member names."""
    found = [n for n in names if n.count("/") == 1 and n.endswith(".dist-info/RECORD")]
    if len(found) != 1:
        raise ValueError(f"expected one top-level *.dist-info/RECORD, found {found}")
    return found[0]


def parse_record(text: str) -> list[tuple[str, str, str]]:
    """Rows (path, hash, size) of a RECORD file's text."""
    return [(r[0], r[1], r[2]) for r in csv.reader(io.StringIO(text)) if r]


def filter_record(text: str, drop: Callable[[str], bool]) -> tuple[str, list[str]]:
    """RECORD text without the rows ``drop`` accepts (kept rows byte for byte), and the dropped paths."""
    kept: list[str] = []
    dropped: list[str] = []
    for line in text.splitlines(keepends=True):
        if not line.strip():
            continue
        path = next(csv.reader([line]))[0]
        if drop(path):
            dropped.append(path)
        else:
            kept.append(line if line.endswith("\n") else line + "\n")
    return "".join(kept), dropped


@dataclass
class RewriteStats:
    """What ``rewrite_wheel`` left out and the sizes before and after."""

    dropped: list[tuple[str, int, int]] = field(default_factory=list)  # (name, size, packed size)
    kept: int = 0
    size_before: int = 0
    size_after: int = 0

    @property
    def dropped_bytes(self) -> int:
        """Unpacked bytes of the dropped members."""
        return sum(s for _, s, _ in self.dropped)


def rewrite_wheel(
    src: Path, dst: Path, drop: Callable[[str], bool] | None = None, compression: int = zipfile.ZIP_DEFLATED
) -> RewriteStats:
    """Copy wheel ``src`` to ``dst`` without the members ``drop`` accepts, RECORD rewritten to match."""
    drop = drop or (lambda _name: False)
    stats = RewriteStats(size_before=src.stat().st_size)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".tmp")
    with zipfile.ZipFile(src) as zin:
        infos = zin.infolist()
        record = record_name(i.filename for i in infos)
        signatures = {record.rsplit("/", 1)[0] + "/" + s for s in RECORD_SIGNATURES}

        def gone(name: str) -> bool:
            return name in signatures or (name != record and drop(name))

        record_text, dropped_rows = filter_record(zin.read(record).decode("utf-8"), gone)
        with zipfile.ZipFile(tmp, "w", compression) as zout:
            for info in infos:
                if info.is_dir():
                    continue
                if info.filename != record and gone(info.filename):
                    stats.dropped.append((info.filename, info.file_size, info.compress_size))
                    continue
                out = zipfile.ZipInfo(info.filename, info.date_time)
                out.external_attr = info.external_attr
                out.create_system = info.create_system
                out.compress_type = compression
                if info.filename == record:
                    zout.writestr(out, record_text.encode("utf-8"))
                else:
                    with zin.open(info) as fin, zout.open(out, "w") as fout:
                        shutil.copyfileobj(fin, fout, 8 * MIB)
                stats.kept += 1
    unlisted = sorted({n for n, _, _ in stats.dropped} - set(dropped_rows))
    if unlisted:
        tmp.unlink()
        raise ValueError(f"{src.name}: dropped members without a RECORD row: {unlisted[:5]}")
    tmp.replace(dst)
    stats.size_after = dst.stat().st_size
    return stats


def verify_wheel(path: Path) -> list[str]:
    """Problems of a wheel's RECORD against its members: hash, size, unlisted members, rows without one."""
    problems: list[str] = []
    with zipfile.ZipFile(path) as z:
        names = [i.filename for i in z.infolist() if not i.is_dir()]
        record = record_name(names)
        rows = {p: (h, s) for p, h, s in parse_record(z.read(record).decode("utf-8"))}
        for name in names:
            if name not in rows:
                problems.append(f"{name}: member without a RECORD row")
                continue
            want_hash, want_size = rows.pop(name)
            if name == record:
                continue
            h = hashlib.sha256()
            size = 0
            with z.open(name) as f:
                while chunk := f.read(8 * MIB):
                    h.update(chunk)
                    size += len(chunk)
            got = "sha256=" + base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode("ascii")
            if want_hash != got:
                problems.append(f"{name}: RECORD hash {want_hash}, member {got}")
            if want_size and int(want_size) != size:
                problems.append(f"{name}: RECORD size {want_size}, member {size}")
        problems.extend(f"{p}: RECORD row without a member" for p in rows)
    return problems


def hopper_drop(name: str) -> bool:
    """Whether a vLLM wheel member is one a Hopper run never loads (see the notes above ``FA2_MEMBER``)."""
    if name in (FA2_MEMBER, RUST_FRONTEND_MEMBER):
        return True
    return name.startswith(THIRD_PARTY) and name.endswith(HEADER_SUFFIXES)


# ---- parts -------------------------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(8 * MIB):
            h.update(chunk)
    return h.hexdigest()


def split_file(src: Path, out: Path, part_bytes: int, stem: str | None = None) -> list[dict[str, Any]]:
    """Split ``src`` into ``out/partN/<stem>.partN`` files of <= ``part_bytes``; their manifest entries."""
    if part_bytes <= 0:
        raise ValueError("part size must be positive")
    stem = stem or src.name
    parts: list[dict[str, Any]] = []
    with src.open("rb") as f:
        n = 0
        while True:
            n += 1
            name = f"{stem}.part{n}"
            d = out / f"part{n}"
            d.mkdir(parents=True, exist_ok=True)
            h = hashlib.sha256()
            size = 0
            with (d / name).open("wb") as fout:
                while size < part_bytes and (chunk := f.read(min(8 * MIB, part_bytes - size))):
                    fout.write(chunk)
                    h.update(chunk)
                    size += len(chunk)
            if size == 0 and n > 1:
                (d / name).unlink()
                d.rmdir()
                break
            parts.append({"name": name, "dir": f"part{n}", "size": size, "sha256": h.hexdigest()})
            if size < part_bytes:
                break
    return parts


def verify_parts(where: Path, manifest: dict[str, Any], only: int | None = None) -> list[Path]:
    """The manifest's parts (or part ``only``), flat in ``where``, checked for size and sha256."""
    parts = manifest["parts"]
    total = len(parts)
    if only is not None and not 1 <= only <= total:
        raise PartError(f"part {only}: MANIFEST.json lists parts 1..{total}")
    numbered = [(i, part) for i, part in enumerate(parts, 1) if only in (None, i)]
    paths: list[Path] = []
    missing: list[str] = []
    for i, part in numbered:
        p = where / part["name"]
        if not p.is_file():
            src = f"{manifest.get('out', '.gpuwh')}/{part['dir']}"
            missing.append(
                f"part {i}/{total} ({part['name']}): a call with carry=['{src}'] runs"
                f" `bash tests/gpu/install_wheelhouse.sh stash {i}`"
            )
        paths.append(p)
    if missing:
        raise PartError(f"missing in {where}: " + "; ".join(missing))
    for (i, part), p in zip(numbered, paths, strict=True):
        size = p.stat().st_size
        if size != part["size"]:
            raise PartError(
                f"corrupt part {i}/{total}: {p} has {size} bytes, MANIFEST says {part['size']}"
                " -- stash it again"
            )
        got = sha256_file(p)
        if got != part["sha256"]:
            raise PartError(
                f"corrupt part {i}/{total}: {p} has sha256 {got}, MANIFEST says {part['sha256']}"
                " -- stash it again"
            )
    return paths


def join_parts(paths: Sequence[Path], dest: Path, sha256: str) -> Path:
    """Concatenate ``paths`` into ``dest`` and check the whole against ``sha256`` (``PartError`` if not)."""
    h = hashlib.sha256()
    with dest.open("wb") as fout:
        for p in paths:
            with p.open("rb") as fin:
                while chunk := fin.read(8 * MIB):
                    fout.write(chunk)
                    h.update(chunk)
    if h.hexdigest() != sha256:
        dest.unlink()
        raise PartError(f"joined {dest.name} has sha256 {h.hexdigest()}, MANIFEST says {sha256}")
    return dest


def unpack(where: Path) -> Path:
    """Check the parts stashed in ``where`` against MANIFEST.json, join them, untar: ``where/wheels``."""
    mpath = where / MANIFEST
    if not mpath.is_file():
        raise PartError(f"{mpath} missing: it comes with part 1 (.gpuwh/part1/) -- stash part 1 first")
    manifest = json.loads(mpath.read_text())
    paths = verify_parts(where, manifest)
    payload = join_parts(paths, where / manifest["payload"], manifest["sha256"])
    wheels = where / "wheels"
    if wheels.exists():
        shutil.rmtree(wheels)
    if manifest.get("compression") == "zstd":
        exe = shutil.which("zstd")
        if exe is None:
            raise PartError("the payload is zstd but this machine has no zstd: rebuild with --compress xz")
        with subprocess.Popen([exe, "-dc", "--long=27", str(payload)], stdout=subprocess.PIPE) as proc:
            assert proc.stdout is not None
            with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
                extract_all(tar, where)
        if proc.returncode:
            raise PartError(f"zstd -d failed on {payload} ({proc.returncode})")
    else:
        with tarfile.open(payload, "r:*") as tar:  # plain or xz (Python's lzma)
            extract_all(tar, where)
    payload.unlink()
    want = {w["file"] for w in manifest["wheels"]}
    got = {p.name for p in wheels.glob("*.whl")}
    if want != got:
        raise PartError(f"unpacked wheels differ from MANIFEST: missing {want - got}, extra {got - want}")
    return wheels


def extract_all(tar: tarfile.TarFile, where: Path) -> None:
    """Extract ``tar`` into ``where`` with the "data" filter (no links out, no absolute paths)."""
    tar.extractall(where, filter="data")


def link_or_copy(src: Path, dest: Path) -> None:
    """Hard-link ``src`` to ``dest`` (replacing it), or copy where links don't work."""
    dest.unlink(missing_ok=True)
    try:
        os.link(src, dest)
    except OSError:
        shutil.copy2(src, dest)


def make_tar(files: Sequence[Path], dest: Path, arcdir: str = "wheels") -> Path:
    """A deterministic uncompressed tar of ``files`` under ``arcdir/`` (sorted, mtime 0, root-owned, 0644)."""
    with tarfile.open(dest, "w", format=tarfile.PAX_FORMAT) as tar:
        d = tarfile.TarInfo(arcdir)
        d.type = tarfile.DIRTYPE
        d.mode = 0o755
        tar.addfile(d)
        for f in sorted(files, key=lambda p: p.name):
            info = tarfile.TarInfo(f"{arcdir}/{f.name}")
            info.size = f.stat().st_size
            info.mode = 0o644
            with f.open("rb") as fin:
                tar.addfile(info, fin)
    return dest


# ---- requirements ------------------------------------------------------------------------------------------


def canonical(name: str) -> str:
    """PEP 503 normalized project name."""
    from packaging.utils import canonicalize_name

    return str(canonicalize_name(name))


def wheel_metadata(path: Path) -> tuple[str, str, list[str]]:
    """(name, version, Requires-Dist lines) from a wheel's METADATA."""
    from email.parser import Parser

    with zipfile.ZipFile(path) as z:
        meta_name = next(n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
        msg = Parser().parsestr(z.read(meta_name).decode("utf-8"), headersonly=True)
    return str(msg["Name"]), str(msg["Version"]), [str(r) for r in msg.get_all("Requires-Dist") or []]


def active_requirements(lines: Iterable[str]) -> list[Any]:
    """The non-extra requirements among Requires-Dist ``lines`` whose markers hold on the machine."""
    from packaging.requirements import Requirement

    out = []
    for line in lines:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(dict(MARKER_ENV)):
            out.append(req)
    return out


@dataclass
class CheckResult:
    """Requirement check of the wheelhouse against itself and the H200 image."""

    missing: list[str] = field(default_factory=list)  # runtime wheels: needed, in neither
    conflicts: list[str] = field(default_factory=list)  # a known version outside a specifier
    not_carried: list[str] = field(default_factory=list)  # vLLM's own requirements in neither (--no-deps)
    image_unknown: dict[str, dict[str, list[str]]] = field(default_factory=dict)  # dep -> spec -> who


def check_requirements(wheels: dict[str, tuple[str, list[str]]], top: str = "vllm") -> CheckResult:
    """Check every wheel's active Requires-Dist against the wheelhouse versions and the image's packages."""
    have = {name: version for name, (version, _) in wheels.items()}
    res = CheckResult()
    for name, (version, lines) in sorted(wheels.items()):
        for req in active_requirements(lines):
            dep = canonical(req.name)
            who = f"{name} {version}"
            if dep in have:
                if not req.specifier.contains(have[dep], prereleases=True):
                    res.conflicts.append(f"{who} needs {req}, the wheelhouse has {dep} {have[dep]}")
            elif dep in IMAGE_PACKAGES:
                known = IMAGE_VERSIONS.get(dep)
                if known is not None:
                    if not req.specifier.contains(known, prereleases=True):
                        res.conflicts.append(f"{who} needs {req}, the image has {dep} {known}")
                elif str(req.specifier):
                    res.image_unknown.setdefault(dep, {}).setdefault(str(req.specifier), []).append(name)
            elif name == top:
                res.not_carried.append(f"{dep}{req.specifier}")
            else:
                res.missing.append(f"{who} needs {req}: neither in the image nor in the wheelhouse")
    return res


def check_pins(vllm_requires: Iterable[str], pins: dict[str, str]) -> list[str]:
    """Pins that break vLLM's own Requires-Dist."""
    bad = []
    for req in active_requirements(vllm_requires):
        dep = canonical(req.name)
        if dep in pins and not req.specifier.contains(pins[dep], prereleases=True):
            bad.append(f"vllm needs {req}, PINS has {dep}=={pins[dep]}")
    return bad


# ---- downloads ---------------------------------------------------------------------------------------------


def supported_tags() -> list[Any]:
    """Wheel tags a cp312 manylinux x86_64 interpreter accepts, best first."""
    from packaging import tags

    plats = list(PLATFORMS)
    return [
        *tags.cpython_tags((3, 12), abis=["cp312"], platforms=plats),
        *tags.compatible_tags((3, 12), "cp312", plats),
    ]


def find_wheel(where: Path, name: str, version: str, ranked: dict[Any, int]) -> Path | None:
    """The best-tagged wheel of ``name==version`` in ``where`` that the machine accepts, if any."""
    from packaging.utils import InvalidWheelFilename, parse_wheel_filename
    from packaging.version import Version

    best: tuple[int, Path] | None = None
    for p in sorted(where.glob("*.whl")):
        try:
            wname, wversion, _, wtags = parse_wheel_filename(p.name)
        except InvalidWheelFilename:
            continue
        if str(wname) != canonical(name) or wversion != Version(version):
            continue
        rank = min((ranked[t] for t in wtags if t in ranked), default=None)
        if rank is not None and (best is None or rank < best[0]):
            best = (rank, p)
    return best[1] if best else None


def pip_download(reqs: Sequence[str], dest: Path) -> None:
    """``pip download`` cp312 manylinux x86_64 wheels of ``reqs`` (no deps) into ``dest``."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
    ]
    cmd += ["--python-version", "3.12", "--implementation", "cp", "-d", str(dest)]
    for plat in PLATFORMS:
        cmd += ["--platform", plat]
    print(f"  pip download {' '.join(reqs)}", flush=True)
    subprocess.run([*cmd, *reqs], check=True)


def fetch_wheels(dl: Path, wanted: dict[str, str]) -> dict[str, tuple[Path, bool]]:
    """Paths of the ``name==version`` wheels, from ``dl`` when already there (True) or downloaded (False)."""
    dl.mkdir(parents=True, exist_ok=True)
    ranked = {t: i for i, t in enumerate(supported_tags())}
    found: dict[str, tuple[Path, bool]] = {}
    todo: list[str] = []
    for name, version in wanted.items():
        p = find_wheel(dl, name, version, ranked)
        if p is None:
            todo.append(f"{name}=={version}")
        else:
            found[name] = (p, True)
    if todo:
        pip_download(todo, dl)
        for req in todo:
            name, version = req.split("==")
            p = find_wheel(dl, name, version, ranked)
            if p is None:
                raise SystemExit(f"pip downloaded no cp312 manylinux x86_64 wheel for {req} into {dl}")
            found[name] = (p, False)
    return found


# ---- compression and cache ---------------------------------------------------------------------------------


def compress(src: Path, codec: str, dest: Path) -> float:
    """Compress ``src`` to ``dest`` with ``codec`` ("xz" or "zstd"); the seconds it took."""
    t0 = time.monotonic()
    tmp = dest.with_name(dest.name + ".tmp")
    exe = shutil.which(codec)
    if codec == "xz" and exe is None:
        import lzma

        with src.open("rb") as fin, lzma.open(tmp, "wb", preset=9) as fout:
            shutil.copyfileobj(fin, fout, 8 * MIB)
    elif exe is None:
        raise SystemExit(f"no {codec} binary here")
    else:
        args = XZ_ARGS if codec == "xz" else (*ZSTD_ARGS, "-q")
        with src.open("rb") as fin, tmp.open("wb") as fout:
            subprocess.run([exe, *args, "-c"], stdin=fin, stdout=fout, check=True)
    tmp.replace(dest)
    return time.monotonic() - t0


class Cache:
    """sha256-keyed record of built files under ``OUT/build`` so reruns skip the slow steps."""

    def __init__(self, path: Path) -> None:
        """Load ``path`` (empty when absent or unreadable)."""
        self.path = path
        try:
            self.data: dict[str, dict[str, Any]] = json.loads(path.read_text())
        except (OSError, ValueError):
            self.data = {}

    def get(self, key: str) -> dict[str, Any] | None:
        """The entry for ``key`` if its file is still there with the recorded size."""
        e = self.data.get(key)
        if e is None:
            return None
        p = Path(e["file"])
        if not p.is_file() or p.stat().st_size != e["size"]:
            return None
        return e

    def put(self, key: str, path: Path, **extra: Any) -> dict[str, Any]:
        """Record ``path`` (size, sha256 and ``extra``) under ``key``."""
        e = {"file": str(path), "size": path.stat().st_size, "sha256": sha256_file(path), **extra}
        self.data[key] = e
        self.path.write_text(json.dumps(self.data, indent=1, sort_keys=True))
        return e


# ---- the build ---------------------------------------------------------------------------------------------


def mb(n: float) -> str:
    """Bytes as MB and MiB."""
    return f"{n / 1e6:.1f} MB ({n / MIB:.1f} MiB)"


def nparts(size: int, part_bytes: int) -> int:
    """How many parts of at most ``part_bytes`` ``size`` bytes take."""
    return max(1, -(-size // part_bytes))


def build_variant(
    variant: str, vllm_src: Path, deps: dict[str, Path], build: Path, cache: Cache, src_sha: dict[Path, str]
) -> tuple[Path, list[Path], RewriteStats | None]:
    """The tar of a variant: "deflate" (wheels as published, slim vLLM deflated) or "stored" (all stored)."""
    wdir = build / variant
    if wdir.exists():
        shutil.rmtree(wdir)
    wdir.mkdir(parents=True)
    stored = variant == "stored"
    compression = zipfile.ZIP_STORED if stored else zipfile.ZIP_DEFLATED
    files: list[Path] = []
    stats: RewriteStats | None = None
    key = f"slim:{DROP_RULES}:{src_sha[vllm_src]}:{variant}"
    hit = cache.get(key)
    slim = build / f"slim-{variant}" / vllm_src.name
    if hit is not None and Path(hit["file"]) == slim:
        s = hit["stats"]
        stats = RewriteStats(kept=s["kept"], size_before=s["size_before"], size_after=s["size_after"])
        stats.dropped = [(str(n), int(a), int(b)) for n, a, b in s["dropped"]]
    else:
        stats = rewrite_wheel(vllm_src, slim, hopper_drop, compression)
        problems = verify_wheel(slim)
        if problems:
            raise SystemExit(f"slim vLLM wheel fails its RECORD check: {problems[:5]}")
        cache.put(key, slim, stats=stats.__dict__)
    files.append(slim)
    for p in deps.values():
        if stored:
            key = f"stored:{src_sha[p]}"
            out = build / "stored-deps" / p.name
            hit = cache.get(key)
            if hit is None or Path(hit["file"]) != out:
                rewrite_wheel(p, out, None, zipfile.ZIP_STORED)
                cache.put(key, out)
            files.append(out)
        else:
            files.append(p)
    for f in files:
        link_or_copy(f, wdir / f.name)
    tar = make_tar(sorted(wdir.glob("*.whl")), build / f"{TAR_NAME}.{variant}")
    return tar, files, stats


def with_overrides(
    pins: dict[str, str], overrides: Sequence[str], adds: Sequence[str] = ()
) -> dict[str, str]:
    """``pins`` with each ``NAME==VERSION`` of ``overrides`` in its place and those of ``adds`` added (wheels
    another vLLM imports that 0.26.0 does not); ValueError naming a bad one."""
    out = dict(pins)
    for flag, items in (("--pin", overrides), ("--add", adds)):
        for item in items:
            name, sep, version = (x.strip() for x in item.partition("=="))
            if not sep or not name or not version:
                raise ValueError(f"{flag} {item!r}: expected NAME==VERSION")
            if flag == "--pin" and name not in pins:
                raise ValueError(f"--pin {item!r}: {name} is not one of PINS ({', '.join(sorted(pins))})")
            if flag == "--add" and name in out:
                raise ValueError(f"--add {item!r}: {name} is in the wheelhouse already (--pin replaces it)")
            out[name] = version
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Build the wheelhouse (default); ``unpack DIR`` and ``check DIR SITE`` are for the machine."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["unpack"]:
        return unpack_main(argv[1:])
    if argv[:1] == ["check"]:
        return check_main(argv[1:])
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(".gpuwh"), help="output folder (default .gpuwh)")
    ap.add_argument("--part-mib", type=float, default=60, help="largest part in MiB (default 60)")
    ap.add_argument("--vllm", default=VLLM_VERSION, help=f"vLLM version (default {VLLM_VERSION})")
    ap.add_argument("--download-dir", type=Path, help="where wheels are downloaded/reused (default OUT/dl)")
    ap.add_argument(
        "--compress",
        choices=["auto", "none", "xz", "zstd"],
        default="auto",
        help="auto (default): measure the plain tar and xz; take xz only if it saves a part",
    )
    ap.add_argument(
        "--pin",
        action="append",
        default=[],
        metavar="NAME==VERSION",
        help="replace one of PINS (repeatable): another vLLM's own exact pins, e.g. apache-tvm-ffi==0.1.9",
    )
    ap.add_argument(
        "--add",
        action="append",
        default=[],
        metavar="NAME==VERSION",
        help="carry one more wheel (repeatable): what another vLLM imports at start, e.g. gguf==0.19.0",
    )
    args = ap.parse_args(argv)
    try:
        pins = with_overrides(PINS, args.pin, args.add)
    except ValueError as e:
        ap.error(str(e))
    out: Path = args.out
    dl: Path = args.download_dir or out / "dl"
    build = out / "build"
    build.mkdir(parents=True, exist_ok=True)
    cache = Cache(build / CACHE)
    part_bytes = int(args.part_mib * MIB)

    print(f"== 1. wheels (cp312, manylinux x86_64) in {dl}")
    vllm_src, vllm_reused = fetch_wheels(dl, {"vllm": args.vllm})["vllm"]
    _, _, vllm_requires = wheel_metadata(vllm_src)
    bad = check_pins(vllm_requires, pins)
    if bad:
        print("PINS break vLLM's Requires-Dist:\n  " + "\n  ".join(bad), file=sys.stderr)
        return 2
    if args.vllm != VLLM_VERSION:
        print(f"  note: PINS were chosen for vLLM {VLLM_VERSION}; they satisfy {args.vllm}'s Requires-Dist")
    deps_found = fetch_wheels(dl, pins)
    for name, (p, reused) in sorted({"vllm": (vllm_src, vllm_reused), **deps_found}.items()):
        how = "reused" if reused else "downloaded"
        print(f"  {name:<22}{({'vllm': args.vllm} | pins)[name]:<16}{mb(p.stat().st_size):<24}{how}")
    deps = {n: p for n, (p, _) in deps_found.items()}

    print("\n== requirement check (python 3.12.3, linux x86_64; image packages as listed on 2026-11-17)")
    metas: dict[str, tuple[str, list[str]]] = {"vllm": (args.vllm, vllm_requires)}
    for name, p in deps.items():
        _, version, requires = wheel_metadata(p)
        metas[canonical(name)] = (version, requires)
    res = check_requirements(metas)
    for line in res.missing:
        print(f"  MISSING   {line}")
    for line in res.conflicts:
        print(f"  CONFLICT  {line}")
    if not res.missing and not res.conflicts:
        print("  every runtime wheel's requirements are in the wheelhouse or the image; no version conflicts")
    print("  vLLM requirements not carried (vLLM goes in with --no-deps; an offline LLM run was found")
    print(f"  not to import them): {', '.join(res.not_carried)}")
    if res.image_unknown:
        print("  in the image, version not known here (install_wheelhouse.sh checks them there):")
        for dep, specs in sorted(res.image_unknown.items()):
            needs = "; ".join(f"{spec} ({', '.join(who)})" for spec, who in sorted(specs.items()))
            print(f"    {dep:<24} {needs}")

    print("\n== 2. slim vLLM wheel")
    src_sha: dict[Path, str] = {}
    for p in [vllm_src, *deps.values()]:
        key = f"src:{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}"
        hit = cache.data.get(key)
        src_sha[p] = hit["sha256"] if hit else cache.put(key, p)["sha256"]
    variants = (
        ["deflate", "stored"]
        if args.compress == "auto"
        else (["deflate"] if args.compress == "none" else ["stored"])
    )
    tars: dict[str, tuple[Path, list[Path], RewriteStats | None]] = {}
    for v in variants:
        tars[v] = build_variant(v, vllm_src, deps, build, cache, src_sha)
    stats = tars[variants[0]][2]
    assert stats is not None
    by_kind: dict[str, list[int]] = {}
    for name, size, packed in stats.dropped:
        kind = {FA2_MEMBER: "FA2 kernels", RUST_FRONTEND_MEMBER: "vllm-rs"}.get(name, "headers")
        acc = by_kind.setdefault(kind, [0, 0, 0])
        acc[0] += 1
        acc[1] += size
        acc[2] += packed
    for kind, (n, size, packed) in by_kind.items():
        print(f"  dropped {kind:<12} {n:>5} members, {mb(size)} unpacked, {mb(packed)} packed")
    for v in variants:
        slim = tars[v][1][0]
        print(f"  {v:<8} {vllm_src.name}: {mb(vllm_src.stat().st_size)} -> {mb(slim.stat().st_size)}")

    print(f"\n== 3. payload (parts of at most {args.part_mib:g} MiB)")
    candidates: list[tuple[str, Path]] = []
    if "deflate" in tars:
        candidates.append(("none", tars["deflate"][0]))
    if "stored" in tars:
        # auto tries xz alone: zstd packs no smaller here (docs/benchmarks.md), and the machine may lack a
        # zstd binary (its Python 3.12 has no zstd module) while Python's own lzma undoes xz there.
        # --compress zstd builds it.
        codec = "xz" if args.compress == "auto" else args.compress
        if codec == "zstd" and shutil.which("zstd") is None:
            raise SystemExit("--compress zstd: no zstd binary here")
        stored_tar = tars["stored"][0]
        tar_sha = sha256_file(stored_tar)
        dest = build / f"{TAR_NAME}{CODEC_SUFFIX[codec]}.{tar_sha[:12]}"
        args_used = " ".join(XZ_ARGS if codec == "xz" else ZSTD_ARGS)
        key = f"{codec}:{args_used}:{tar_sha}"
        hit = cache.get(key)
        if hit is None:
            for old in build.glob(f"{TAR_NAME}{CODEC_SUFFIX[codec]}.*"):
                old.unlink()
            print(f"  {codec} {args_used} on {mb(stored_tar.stat().st_size)} (minutes) ...", flush=True)
            secs = compress(stored_tar, codec, dest)
            hit = cache.put(key, dest, seconds=round(secs, 1))
        candidates.append((codec, Path(hit["file"])))
    for codec, p in candidates:
        size = p.stat().st_size
        what = "wheels as published, plain tar" if codec == "none" else "stored wheels, whole tar " + codec
        print(f"  {codec:<5} {mb(size):<26} {nparts(size, part_bytes)} part(s)   ({what})")
    # Fewest parts wins; a tie goes to the plain tar (nothing to undo on the machine).
    codec, payload = min(candidates, key=lambda c: (nparts(c[1].stat().st_size, part_bytes), c[0] != "none"))
    final_name = TAR_NAME + CODEC_SUFFIX[codec]
    wheel_files = tars["deflate" if codec == "none" else "stored"][1]
    versions = {"vllm": args.vllm, **pins}
    names = {vllm_src.name: "vllm", **{p.name: n for n, p in deps.items()}}

    for old in out.glob("part*"):
        if old.is_dir() and old.name[4:].isdigit():
            shutil.rmtree(old)
    parts = split_file(payload, out, part_bytes, final_name)
    total_sha = sha256_file(payload)
    manifest = {
        "format": 1,
        "vllm": args.vllm,
        "payload": final_name,
        "compression": codec,
        "size": payload.stat().st_size,
        "sha256": total_sha,
        "part_mib": args.part_mib,
        "out": str(out),
        "parts": parts,
        "wheels": [
            {
                "name": names[f.name],
                "version": versions[names[f.name]],
                "file": f.name,
                "size": f.stat().st_size,
                "sha256": sha256_file(f),
            }
            for f in sorted(wheel_files, key=lambda f: f.name)
        ],
        "dropped_from_vllm": {k: {"members": v[0], "bytes": v[1]} for k, v in by_kind.items()},
    }
    (out / "part1" / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    # Round trip: the parts must join back to the payload.
    with tempfile.TemporaryDirectory(dir=build) as td:
        flat = Path(td)
        for part in parts:
            link_or_copy(out / part["dir"] / part["name"], flat / part["name"])
        join_parts(verify_parts(flat, manifest), flat / final_name, total_sha)
    print(f"  chose {codec}: {final_name} {mb(manifest['size'])}, sha256 {total_sha[:16]}...")
    for part in parts:
        print(f"  {out}/{part['dir']}/{part['name']:<28} {mb(part['size'])}")
    print(f"  {len(parts)} part(s), {len(wheel_files)} wheels; MANIFEST in {out}/part1/{MANIFEST}")
    print("\non the machine, one call per part (each call carries only its own part):")
    for i, part in enumerate(parts, 1):
        last = " && bash tests/gpu/install_wheelhouse.sh install" if i == len(parts) else ""
        print(f"  carry=['{out}/{part['dir']}']  bash tests/gpu/install_wheelhouse.sh stash {i}{last}")
    return 0


def unpack_main(argv: Sequence[str]) -> int:
    """``unpack DIR [--part N]``: verify the parts stashed in DIR (or part N only), join and untar them."""
    ap = argparse.ArgumentParser(prog="wheelhouse.py unpack")
    ap.add_argument("dir", type=Path)
    ap.add_argument("--part", type=int, help="only check this part (when MANIFEST.json is there already)")
    args = ap.parse_args(argv)
    try:
        if args.part is not None:
            manifest = json.loads((args.dir / MANIFEST).read_text())
            verify_parts(args.dir, manifest, args.part)
            print(f"wheelhouse: part {args.part}/{len(manifest['parts'])} ok (sha256 matches MANIFEST.json)")
            return 0
        wheels = unpack(args.dir)
    except PartError as e:
        print(f"wheelhouse: {e}", file=sys.stderr)
        return 3
    print(f"wheelhouse: {len(list(wheels.glob('*.whl')))} wheels in {wheels}")
    return 0


def check_installed(manifest: dict[str, Any], site: Path) -> list[str]:
    """Unmet requirements of the installed wheelhouse, read from ``site`` plus this Python's own packages."""
    import importlib.metadata as md

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    path = [str(site), *sys.path]
    installed: dict[str, str] = {}
    for dist in md.distributions(path=path):
        installed.setdefault(str(canonicalize_name(dist.metadata["Name"])), dist.version)
    lines: list[str] = []
    not_carried: list[str] = []
    for w in manifest["wheels"]:
        name = str(canonicalize_name(w["name"]))
        if installed.get(name) != w["version"]:
            lines.append(f"{name} {w['version']} is not what {site} holds ({installed.get(name)})")
            continue
        mine = next(iter(md.distributions(name=name, path=[str(site)])), None)
        for line in (mine.requires if mine else None) or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            dep = str(canonicalize_name(req.name))
            have = installed.get(dep)
            if have is None:
                if name == "vllm":
                    not_carried.append(dep)
                else:
                    lines.append(f"{name} needs {req}: not installed")
            elif not req.specifier.contains(have, prereleases=True):
                lines.append(f"{name} needs {req}: {dep} {have} is installed")
    if not_carried:
        lines.append(
            f"(vLLM requirements not carried, as planned: {len(not_carried)}: {' '.join(not_carried)})"
        )
    return lines


def check_main(argv: Sequence[str]) -> int:
    """``check DIR SITE``: print the unmet requirements of the wheelhouse installed in SITE (run there)."""
    ap = argparse.ArgumentParser(prog="wheelhouse.py check")
    ap.add_argument("dir", type=Path)
    ap.add_argument("site", type=Path)
    args = ap.parse_args(argv)
    manifest = json.loads((args.dir / MANIFEST).read_text())
    lines = check_installed(manifest, args.site)
    for line in lines:
        print(f"wheelhouse: {line}")
    bad = [x for x in lines if not x.startswith("(")]
    print(f"wheelhouse: requirement check: {len(bad)} unmet" + ("" if bad else " (all met)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
