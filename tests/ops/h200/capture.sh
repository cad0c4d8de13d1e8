#!/usr/bin/env bash
# Run on the lent H200 (device tool): capture real nvidia-smi outputs for the parser fixtures and check
# that agent/gpus.py sees a process holding GPU memory, with pids that match the process's own.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
q_gpu='--query-gpu=index,uuid,name,memory.total,memory.used,utilization.gpu,temperature.gpu'
q_app='--query-compute-apps=pid,gpu_uuid,used_memory'
fmt='--format=csv,noheader,nounits'
nvidia-smi > "$OUT/nvidia-smi-idle.txt" 2>&1
nvidia-smi "$q_gpu" "$fmt" > "$OUT/query-gpu-idle.csv" 2>&1
nvidia-smi "$q_app" "$fmt" > "$OUT/query-apps-idle.csv" 2>&1
# A process that holds 20 GiB and says when it has them.
python3 -c '
import torch, time, os, sys
x = torch.empty(20 * 1024**3, dtype=torch.uint8, device="cuda"); torch.cuda.synchronize()
print("holding", os.getpid(), flush=True); time.sleep(60)' > /tmp/holder.log 2>&1 &
holder=$!
for _ in $(seq 60); do grep -q holding /tmp/holder.log && break; sleep 0.5; done
cat /tmp/holder.log
nvidia-smi > "$OUT/nvidia-smi-busy.txt" 2>&1
nvidia-smi "$q_gpu" "$fmt" > "$OUT/query-gpu-busy.csv" 2>&1
nvidia-smi "$q_app" "$fmt" > "$OUT/query-apps-busy.csv" 2>&1
echo "holder pid (shell) $holder"
python3 -c 'import json, agent.jobs.gpus as g; print(json.dumps(g.query(), indent=1))'
kill "$holder"; wait "$holder" 2>/dev/null
sleep 1
python3 -c 'import json, agent.jobs.gpus as g; print(json.dumps(g.query()))'
nvidia-smi "$q_gpu" "$fmt"
# Older formats the parser should know: full CSV with header and units.
nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.used,utilization.gpu,temperature.gpu --format=csv > "$OUT/query-gpu-header-units.csv" 2>&1
nvidia-smi --version > "$OUT/nvidia-smi-version.txt" 2>&1
uname -a; python3 --version
ls -la "$OUT"
