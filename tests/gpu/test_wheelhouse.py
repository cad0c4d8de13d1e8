"""The pure parts of tests/gpu/wheelhouse.py and install_wheelhouse.sh: RECORD rewriting, parts, unpacking."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import lzma
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.gpu import wheelhouse as wh

SCRIPT = Path(__file__).with_name("install_wheelhouse.sh")
PIP_INSTALL = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]


def make_wheel(path: Path, members: dict[str, bytes], name: str = "vllm", version: str = "0.0.1") -> Path:
    """A small wheel of ``members`` with METADATA, WHEEL and a RECORD that lists them all."""
    info = f"{name}-{version}.dist-info"
    files = dict(members)
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    files[f"{info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: py3-none-any\n"
    )
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    writer.writerows([(n, wh.record_hash(d), len(d)) for n, d in files.items()])
    writer.writerow((f"{info}/RECORD", "", ""))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for n, d in files.items():
            zi = zipfile.ZipInfo(n, (2024, 1, 2, 3, 4, 6))
            zi.external_attr = (0o755 if n.endswith(("vllm-rs", ".so")) else 0o644) << 16
            z.writestr(zi, d)
        z.writestr(f"{info}/RECORD", record.getvalue())
    return path


VLLM_MEMBERS: dict[str, bytes] = {
    "vllm/__init__.py": b"__version__ = '0.0.1'\n",
    "vllm/vllm_flash_attn/__init__.py": b"",
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": b"\x7fELF fa2" * 500,
    "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": b"\x7fELF fa3" * 300,
    "vllm/vllm-rs": b"\x7fELF rust",
    "vllm/third_party/__init__.py": b"",
    "vllm/third_party/deep_gemm/__init__.py": b"x = 1\n",
    "vllm/third_party/deep_gemm/include/cute/tensor.hpp": b"#pragma once\n",
    "vllm/third_party/deep_gemm/include/cutlass/cutlass.h": b"#pragma once\n",
    "vllm/third_party/fmha_sm100/csrc/kernel.cuh": b"// cuh\n",
    "vllm/third_party/fmha_sm100/cute/x.inl": b"// inl\n",
    "vllm/third_party/fmha_sm100/csrc/plan.cu": b"// kept: not a header\n",
    "vllm/csrc_note.h": b"// outside third_party: kept\n",
    "vllm/a,b.py": b"# a path RECORD must quote\n",
}
DROPPED = {
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
    "vllm/vllm-rs",
    "vllm/third_party/deep_gemm/include/cute/tensor.hpp",
    "vllm/third_party/deep_gemm/include/cutlass/cutlass.h",
    "vllm/third_party/fmha_sm100/csrc/kernel.cuh",
    "vllm/third_party/fmha_sm100/cute/x.inl",
}


def test_hopper_drop_picks_fa2_rust_frontend_and_third_party_headers() -> None:
    assert {n for n in VLLM_MEMBERS if wh.hopper_drop(n)} == DROPPED
    assert not wh.hopper_drop("vllm-0.26.0.dist-info/RECORD")


@pytest.mark.parametrize("compression", [zipfile.ZIP_DEFLATED, zipfile.ZIP_STORED])
def test_rewrite_wheel_drops_members_and_their_record_rows(tmp_path: Path, compression: int) -> None:
    src = make_wheel(tmp_path / "vllm-0.0.1-py3-none-any.whl", VLLM_MEMBERS)
    assert wh.verify_wheel(src) == []
    dst = tmp_path / "slim" / src.name
    stats = wh.rewrite_wheel(src, dst, wh.hopper_drop, compression)

    assert {n for n, _, _ in stats.dropped} == DROPPED
    assert stats.dropped_bytes == sum(len(VLLM_MEMBERS[n]) for n in DROPPED)
    with zipfile.ZipFile(src) as zs, zipfile.ZipFile(dst) as zd:
        names = zd.namelist()
        assert set(names) == set(zs.namelist()) - DROPPED
        assert all(i.compress_type == compression for i in zd.infolist())
        for n in names:  # kept members unchanged, exec bits and dates too
            if not n.endswith("RECORD"):
                assert zd.read(n) == zs.read(n)
                assert zd.getinfo(n).external_attr == zs.getinfo(n).external_attr
                assert zd.getinfo(n).date_time == zs.getinfo(n).date_time
        record = wh.record_name(names)
        old_rows = zs.read(record).decode().splitlines(keepends=True)
        new_text = zd.read(record).decode()
    rows = wh.parse_record(new_text)
    assert {p for p, _, _ in rows} == set(names)  # every member listed, no row for a dropped one
    assert not {p for p, _, _ in rows} & DROPPED
    assert new_text.splitlines(keepends=True) == [
        r for r in old_rows if wh.parse_record(r)[0][0] not in DROPPED
    ]
    assert '"vllm/a,b.py"' in new_text  # the quoted row kept byte for byte
    assert wh.verify_wheel(dst) == []  # RECORD hashes and sizes of the kept members still match


def test_verify_wheel_reports_a_wrong_hash_and_an_unlisted_member(tmp_path: Path) -> None:
    src = make_wheel(tmp_path / "vllm-0.0.1-py3-none-any.whl", {"vllm/__init__.py": b"a"})
    bad = tmp_path / "bad.whl"
    with zipfile.ZipFile(src) as zs, zipfile.ZipFile(bad, "w") as zd:
        for i in zs.infolist():
            zd.writestr(i, b"b" if i.filename == "vllm/__init__.py" else zs.read(i))
        zd.writestr("vllm/extra.py", b"")
    problems = wh.verify_wheel(bad)
    assert any(p.startswith("vllm/__init__.py: RECORD hash") for p in problems)
    assert "vllm/extra.py: member without a RECORD row" in problems


def test_rewrite_refuses_to_drop_a_member_recorded_nowhere(tmp_path: Path) -> None:
    src = make_wheel(tmp_path / "vllm-0.0.1-py3-none-any.whl", {"vllm/__init__.py": b""})
    with zipfile.ZipFile(src, "a") as z:
        z.writestr("vllm/vllm-rs", b"unlisted")
    with pytest.raises(ValueError, match="without a RECORD row"):
        wh.rewrite_wheel(src, tmp_path / "out.whl", wh.hopper_drop)
    assert not (tmp_path / "out.whl").exists()


def test_slim_wheel_installs_with_pip(tmp_path: Path) -> None:
    src = make_wheel(tmp_path / "vllm-0.0.1-py3-none-any.whl", VLLM_MEMBERS)
    dst = tmp_path / "slim" / src.name
    wh.rewrite_wheel(src, dst, wh.hopper_drop, zipfile.ZIP_STORED)
    target = tmp_path / "site"
    r = subprocess.run(
        [*PIP_INSTALL, "--target", str(target), str(dst)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert (target / "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so").is_file()
    assert not (target / "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so").exists()
    assert not (target / "vllm/vllm-rs").exists()
    assert (target / "vllm/third_party/fmha_sm100/csrc/plan.cu").is_file()


def split(tmp_path: Path, data: bytes, part_bytes: int, stem: str = "wheelhouse.tar") -> dict:
    """Split ``data`` like the builder does; the manifest."""
    src = tmp_path / "payload"
    src.write_bytes(data)
    out = tmp_path / "out"
    parts = wh.split_file(src, out, part_bytes, stem)
    manifest = {"payload": stem, "sha256": hashlib.sha256(data).hexdigest(), "parts": parts, "wheels": []}
    (out / "part1" / wh.MANIFEST).write_text(json.dumps(manifest))
    return manifest


def stash_all(tmp_path: Path, manifest: dict) -> Path:
    """Copy every part folder flat into one folder, as the stash calls do on the machine."""
    flat = tmp_path / "flat"
    flat.mkdir(exist_ok=True)
    for part in manifest["parts"]:
        for f in (tmp_path / "out" / part["dir"]).iterdir():
            shutil.copy(f, flat / f.name)
    return flat


@pytest.mark.parametrize("size", [2500, 3000, 1, 999])
def test_split_join_round_trip(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    manifest = split(tmp_path, data, 1000)
    assert len(manifest["parts"]) == -(-size // 1000)
    assert all(p["size"] <= 1000 for p in manifest["parts"])
    assert [p["name"] for p in manifest["parts"]] == [
        f"wheelhouse.tar.part{i}" for i in range(1, len(manifest["parts"]) + 1)
    ]
    assert (tmp_path / "out/part1/wheelhouse.tar.part1").is_file()
    flat = stash_all(tmp_path, manifest)
    joined = wh.join_parts(wh.verify_parts(flat, manifest), tmp_path / "joined", manifest["sha256"])
    assert joined.read_bytes() == data


def test_a_corrupt_part_is_named(tmp_path: Path) -> None:
    manifest = split(tmp_path, os.urandom(2500), 1000)
    flat = stash_all(tmp_path, manifest)
    p2 = flat / "wheelhouse.tar.part2"
    b = bytearray(p2.read_bytes())
    b[10] ^= 1
    p2.write_bytes(bytes(b))
    with pytest.raises(wh.PartError, match=r"corrupt part 2/3: .*wheelhouse\.tar\.part2 has sha256"):
        wh.verify_parts(flat, manifest)
    wh.verify_parts(flat, manifest, only=1)  # part 1 alone is fine
    p2.write_bytes(bytes(b[:-1]))
    with pytest.raises(wh.PartError, match=r"corrupt part 2/3: .* has 999 bytes, MANIFEST says 1000"):
        wh.verify_parts(flat, manifest, only=2)


def test_a_missing_part_is_named_with_the_call_that_stashes_it(tmp_path: Path) -> None:
    manifest = split(tmp_path, os.urandom(2500), 1000)
    flat = stash_all(tmp_path, manifest)
    (flat / "wheelhouse.tar.part3").unlink()
    with pytest.raises(wh.PartError, match=r"part 3/3 \(wheelhouse\.tar\.part3\).*stash 3"):
        wh.verify_parts(flat, manifest)


def test_join_checks_the_whole(tmp_path: Path) -> None:
    manifest = split(tmp_path, os.urandom(2500), 1000)
    flat = stash_all(tmp_path, manifest)
    with pytest.raises(wh.PartError, match="joined"):
        wh.join_parts(wh.verify_parts(flat, manifest)[::-1], tmp_path / "joined", manifest["sha256"])
    assert not (tmp_path / "joined").exists()


def xz_wheelhouse(tmp_path: Path, part_bytes: int = 700) -> dict:
    """Two small wheels, tarred and xz'd like the builder's payload, split into parts; the manifest."""
    wheels = [
        make_wheel(tmp_path / "vllm-0.0.1-py3-none-any.whl", {"vllm/__init__.py": os.urandom(900)}),
        make_wheel(tmp_path / "dep-1.0-py3-none-any.whl", {"dep/__init__.py": b""}, "dep", "1.0"),
    ]
    tar = wh.make_tar(wheels, tmp_path / "wheelhouse.tar")
    assert wh.sha256_file(tar) == wh.sha256_file(wh.make_tar(wheels, tmp_path / "again.tar"))  # deterministic
    xz = tmp_path / "wheelhouse.tar.xz"
    xz.write_bytes(lzma.compress(tar.read_bytes()))
    parts = wh.split_file(xz, tmp_path / "out", part_bytes)
    manifest = {
        "payload": xz.name,
        "compression": "xz",
        "sha256": wh.sha256_file(xz),
        "parts": parts,
        "wheels": [
            {"name": "vllm", "version": "0.0.1", "file": wheels[0].name},
            {"name": "dep", "version": "1.0", "file": wheels[1].name},
        ],
    }
    (tmp_path / "out/part1" / wh.MANIFEST).write_text(json.dumps(manifest))
    return manifest


def test_unpack_joins_and_untars(tmp_path: Path) -> None:
    manifest = xz_wheelhouse(tmp_path)
    assert len(manifest["parts"]) >= 2
    flat = stash_all(tmp_path, manifest)
    wheels = wh.unpack(flat)
    assert sorted(p.name for p in wheels.iterdir()) == sorted(w["file"] for w in manifest["wheels"])
    assert not (flat / manifest["payload"]).exists()


def bash(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run install_wheelhouse.sh."""
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, cwd=cwd, capture_output=True, text=True)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_install_script_stash_install_and_errors(tmp_path: Path) -> None:
    manifest = xz_wheelhouse(tmp_path)
    n = len(manifest["parts"])
    machine = tmp_path / "machine"
    env = dict(os.environ)
    env.update(
        GPUWH_SRC=str(tmp_path / "out"),
        GPUWH_DIR=str(machine / "gpuwh"),
        GPUWH_SITE=str(machine / "site"),
        PYTHON=sys.executable,
        GPUWH_CHECK="0",
    )
    r = bash(["stash", "1"], env, tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"part 1/{n} ok" in r.stdout
    r = bash(["install"], env, tmp_path)
    assert r.returncode != 0
    assert f"part 2/{n}" in r.stderr and "stash 2" in r.stderr

    for i in range(2, n + 1):
        r = bash(["stash", str(i)], env, tmp_path)
        assert r.returncode == 0, r.stderr
    # part 2 garbled on its way
    corrupt = machine / "gpuwh" / manifest["parts"][1]["name"]
    corrupt.write_bytes(corrupt.read_bytes()[::-1])
    r = bash(["install"], env, tmp_path)
    assert r.returncode != 0
    assert f"corrupt part 2/{n}" in r.stderr and corrupt.name in r.stderr
    assert not (machine / "site").exists()

    for i in range(2, n + 1):
        r = bash(["stash", str(i)], env, tmp_path)
        assert r.returncode == 0, r.stderr
        assert f"part {i}/{n} ok" in r.stdout
    r = bash(["install"], env, tmp_path)
    assert r.returncode == 0, r.stderr
    assert (machine / "site/vllm/__init__.py").is_file()
    assert (machine / "site/dep").is_dir()
    assert f"export PYTHONPATH={machine / 'site'}" in r.stdout
    r = bash(["install"], env, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "nothing to do" in r.stdout

    r = bash(["stash", "9"], env, tmp_path)
    assert r.returncode != 0 and "part9 is not in this call's tree" in r.stderr


def test_script_keeps_nvlink_multicast_off() -> None:
    text = SCRIPT.read_text()
    assert "export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1" in text


def test_requirement_check_reports_missing_conflicts_and_what_vllm_leaves_behind() -> None:
    metas = {
        "vllm": (
            "0.26.0",
            ["pydantic>=2.12", "anthropic>=0.71", "torch==2.11.0", "pandas; extra == 'bench'"],
        ),
        "pydantic": ("2.14.4", ["pydantic-core==2.50.5", "typing-extensions>=4.16"]),
        "pydantic-core": ("2.50.4", []),
        "openai": ("3.57.0", ["distro>=1", "colorama; sys_platform == 'win32'"]),
    }
    res = wh.check_requirements(metas)
    assert res.not_carried == ["anthropic>=0.71"]
    assert res.missing == ["openai 3.57.0 needs distro>=1: neither in the image nor in the wheelhouse"]
    assert res.conflicts == [
        "pydantic 2.14.4 needs pydantic-core==2.50.5, the wheelhouse has pydantic-core 2.50.4"
    ]
    assert res.image_unknown == {"typing-extensions": {">=4.16": ["pydantic"]}}
    assert wh.check_pins(["llguidance<1.8.0,>=1.7.0", "xgrammar>=0.2.1"], {"llguidance": "1.8.1"}) == [
        "vllm needs llguidance<1.8.0,>=1.7.0, PINS has llguidance==1.8.1"
    ]


def test_pins_fit_the_vllm_requirements_they_were_chosen_for() -> None:
    vllm_reqs = [
        "fastapi[standard]<0.137.0,>=0.133.0",
        "starlette>=1.0.1",
        "openai>=2.0.0",
        "pydantic>=2.12.0",
        "llguidance<1.8.0,>=1.7.0",
        "xgrammar<1.0.0,>=0.2.1",
        "apache-tvm-ffi==0.1.10",
        "pyzmq>=25.0.0",
        "openai-harmony>=0.0.3",
        "opentelemetry-api>=1.27.0",
    ]
    assert wh.check_pins(vllm_reqs, wh.PINS) == []


def test_pin_overrides_take_another_vllms_pins_and_name_a_bad_one() -> None:
    got = wh.with_overrides(wh.PINS, ["apache-tvm-ffi==0.1.9", " llguidance == 1.3.0 "])
    assert got["apache-tvm-ffi"] == "0.1.9" and got["llguidance"] == "1.3.0"
    assert {k: v for k, v in got.items() if k not in ("apache-tvm-ffi", "llguidance")} == {
        k: v for k, v in wh.PINS.items() if k not in ("apache-tvm-ffi", "llguidance")
    }
    assert wh.PINS["apache-tvm-ffi"] == "0.1.10"  # the module's own pins stay as they are
    with pytest.raises(ValueError, match=r"--pin 'xgrammar': expected NAME==VERSION"):
        wh.with_overrides(wh.PINS, ["xgrammar"])
    with pytest.raises(ValueError, match=r"--pin 'torch==2.11.0': torch is not one of PINS"):
        wh.with_overrides(wh.PINS, ["torch==2.11.0"])
    assert wh.with_overrides(wh.PINS, [], ["gguf==0.19.0"])["gguf"] == "0.19.0"  # vLLM 0.20 imports it
    with pytest.raises(ValueError, match=r"--add 'pydantic==2.0': pydantic is in the wheelhouse already"):
        wh.with_overrides(wh.PINS, [], ["pydantic==2.0"])
