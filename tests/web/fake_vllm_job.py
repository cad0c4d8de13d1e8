"""A stand-in extraction job (no GPU here): prints realistic vLLM milestone lines, then writes capture files.

Usage: fake_vllm_job.py OUT_DIR [--progress N] [--delay S] [--broken] [--hang] [--payload T] [--wait-file F]
[--wait-fifo F] [--layer-rms] [--capture] [--files good|drop-layer] [--shutdown] [--stamp]
- ``--broken`` writes ``hs_0.safetensors`` whose hidden states lost their layer axis ([T, H], not [T, L, H]).
- ``--hang`` keeps running after the last line (for stop tests); ``--payload`` prints hostile text in the log.
- ``--wait-file F``: before each progress line wait until F's content (an int) reaches that line's number,
  so a benchmark decides exactly when each milestone line is appended.  ``--wait-fifo F`` does the same
  without polling: before each progress line it blocks reading one line from the named pipe F.
Stdlib only: it runs under whatever Python the agent uses.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time

PREFIX = "(Worker_TP0 pid={pid}) INFO 11-29 09:{m:02d}:{s:02d} [{src}] "


def say(src: str, text: str) -> None:
    """One vLLM-formatted log line, flushed so the agent sees it at once."""
    t = time.gmtime()
    print(PREFIX.format(pid=os.getpid(), m=t.tm_min, s=t.tm_sec, src=src) + text, flush=True)


def write_safetensors(path: str, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A minimal safetensors file (header + non-zero payload) written atomically."""
    sizes = {"I64": 8, "F16": 2, "BF16": 2, "F32": 4}
    header: dict[str, object] = {}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        n = sizes[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw + bytes([1, 60]) * (offset // 2))
    os.replace(tmp, path)


def main() -> int:
    """Print the run's lines in vLLM's order."""
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--progress", type=int, default=3)
    ap.add_argument("--delay", type=float, default=0.2)
    ap.add_argument("--broken", action="store_true")
    ap.add_argument("--hang", action="store_true")
    ap.add_argument("--payload", default="")
    ap.add_argument("--wait-file", default="")
    ap.add_argument("--wait-fifo", default="", help="a named pipe: one line read from it per progress line")
    ap.add_argument("--layer-rms", action="store_true", help="progress lines carry layer_rms (layers 2, 4)")
    ap.add_argument("--capture", action="store_true", help="print the extraction job's own capture lines too")
    ap.add_argument("--stamp", action="store_true", help="progress lines carry t_line_ms (wall clock, ms)")
    ap.add_argument("--files", choices=("good", "drop-layer"), help="write hs_N: layers 2, 4 (or 1)")
    ap.add_argument("--shutdown", action="store_true", help="then a warning, as vLLM's engine shutdown gives")
    ap.add_argument("--flood", type=int, default=0, help="then print this many filler lines")
    ap.add_argument("--flood-milestones", type=int, default=0, help="of which this many are progress markers")
    args, _ignored = ap.parse_known_args()
    os.makedirs(args.out, exist_ok=True)
    say(
        "core.py:105",
        "Initializing a V1 LLM engine (v0.19.1) with config: model='/models/tiny', tensor_parallel_size=1",
    )
    time.sleep(args.delay)
    say(
        "worker_base.py:269",
        "Injected <class 'HiddenStatesWorkerExtension'> into <class 'Worker'> for extended "
        "collective_rpc calls ['_get_captured_states']",
    )
    say("gpu_model_runner.py:4820", "Model loading took 12.52 GiB memory and 31.412345 seconds")
    time.sleep(args.delay)
    say("gpu_worker.py:436", "Available KV cache memory: 48.31 GiB")
    say("kv_cache_utils.py:1319", "GPU KV cache size: 1,582,064 tokens")
    say("gpu_model_runner.py:6046", "Graph capturing finished in 9 secs, took 0.52 GiB")
    say("core.py:283", "init engine (profile, create kv cache, warmup model) took 58.21 seconds")
    if args.payload:
        print(args.payload, flush=True)
        print("ERROR " + args.payload, flush=True)
        print("EAGLEWATCH " + json.dumps({"kind": "warning", "note": args.payload}), flush=True)
    total = max(1, args.progress)
    fifo = os.open(args.wait_fifo, os.O_RDONLY) if args.wait_fifo else -1
    if args.capture:  # what eaglewatch's extraction job says about its capture
        conf = {"kind": "capture_configured", "layers": [2, 4], "convention": "input", "hidden_size": 64,
                "dtype": "bfloat16", "backend": "worker-extension"}  # fmt: skip
        print("EAGLEWATCH " + json.dumps(conf), flush=True)
    for i in range(1, args.progress + 1):
        if fifo >= 0:
            while os.read(fifo, 1) not in (b"\n", b""):
                pass
        elif args.wait_file:
            while True:
                try:
                    with open(args.wait_file) as fh:
                        if int(fh.read().strip() or 0) >= i:
                            break
                except (OSError, ValueError):
                    pass
                time.sleep(0.002)
        else:
            time.sleep(args.delay)
        rec = {"kind": "progress", "samples_done": i * 8, "samples_total": total * 8,
               "tokens_per_s": 1000.0 + 37 * i, "files_written": i}  # fmt: skip
        if args.capture:
            batch = {"kind": "batch_captured", "batch": i, "samples": 8, "tokens": 1000}
            print("EAGLEWATCH " + json.dumps(batch), flush=True)
            rec.update(bytes_written=i * 3 * 2**20, free_bytes=2**40 - i * 2**30, eta_s=60.0 * (total - i))
        if args.files:  # the file this progress line counts, written before the line says so
            layers = 2 if args.files == "good" else 1
            tensors = {"token_ids": ("I64", [16]), "hidden_states": ("BF16", [16, layers, 64])}
            write_safetensors(os.path.join(args.out, f"hs_{i - 1}.safetensors"), tensors)
        if args.stamp:  # when the line was written: the UI hop benchmark measures from here
            rec["t_line_ms"] = round(time.time() * 1000, 3)
        if args.layer_rms:  # layer 4 collapses to zero from the third line on
            rec["layer_rms"] = {"2": 0.5 + 0.01 * i, "4": 1.5 if i < 3 else 0.0}
        print("EAGLEWATCH " + json.dumps(rec), flush=True)
    if args.flood:
        every = max(1, args.flood // max(1, args.flood_milestones)) if args.flood_milestones else 0
        out = sys.stdout
        for n in range(1, args.flood + 1):
            if every and n % every == 0 and n // every <= args.flood_milestones:
                rec = {"kind": "progress", "samples_done": n // every, "samples_total": args.flood_milestones}
                out.write("EAGLEWATCH " + json.dumps(rec) + "\n")
            else:
                out.write(PREFIX.format(pid=os.getpid(), m=0, s=0, src="scheduler.py:88") +
                          f"step {n}: scheduled 8 requests, {n % 977} tokens\n")  # fmt: skip
        out.flush()
    if args.broken:
        # The known failure: the layer dimension vanished, hidden states are [T, H] instead of [T, L, H].
        write_safetensors(os.path.join(args.out, "hs_0.safetensors"),
                          {"token_ids": ("I64", [16]), "hidden_states": ("BF16", [16, 64])})  # fmt: skip
        say("capture.py:88", "wrote hs_0.safetensors")
    if args.capture:
        done = {
            "kind": "completed",
            "samples": total * 8,
            "files": total,
            "tokens": total * 1000,
            "seconds": 1.0,
        }
        print("EAGLEWATCH " + json.dumps(done), flush=True)
    if args.shutdown:  # a warning after completion, as vLLM's engine shutdown gives
        note = {"kind": "warning", "note": "engine core exited unexpectedly"}
        print("EAGLEWATCH " + json.dumps(note), flush=True)
    if args.hang:
        while True:
            time.sleep(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
