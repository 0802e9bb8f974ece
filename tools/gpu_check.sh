#!/usr/bin/env bash
# The GPU lane (see [Note: GPU test lane] in zero_core.testing.gpu_lane): runs every test marked
# `gpu` (the parity suite of tests/test_gpu_lane.py: stages 0-3, CPU offload, bf16/fp16,
# checkpoint save/load on CUDA with NCCL) and prints a summary. Where CUDA is present it also
# writes the lane's timings, with the device named, to tools/bench/results/gpu_lane.md.
# Where CUDA is absent the tests are skipped with a "needs CUDA: ..." reason (shown below).
#
#   tools/gpu_check.sh                   # with hatch's environment
#   PYTHON=python tools/gpu_check.sh     # with an environment of your own (a CUDA build of torch)
#   ZERO_GPU_LANE_FORCE_CPU=1 tools/gpu_check.sh   # the same suite on CPU/gloo (lane development)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-"hatch run python"}
timings=$(mktemp /tmp/zero_gpu_lane_XXXXXX.json)
log=$(mktemp /tmp/zero_gpu_lane_XXXXXX.log)
trap 'rm -f "$timings" "$log"' EXIT

echo "== zero GPU lane: $(git rev-parse --short HEAD 2>/dev/null || echo '?') on $(hostname)"
$PY -m zero_core.testing.gpu_lane

start=$(date +%s)
ZERO_GPU_LANE_TIMINGS="$timings" $PY -m pytest -m gpu -rs -q -p no:cacheprovider tests/test_gpu_lane.py \
    packages 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
elapsed=$(( $(date +%s) - start ))

echo "== summary (${elapsed} s, pytest exit status ${status})"
grep -E "^(SKIPPED|FAILED|ERROR)|passed|failed|skipped|deselected" "$log" | tail -n 20

if [ -s "$timings" ] && [ "${ZERO_GPU_LANE_FORCE_CPU:-}" != "1" ]; then
  ZERO_LANE_STATUS=$status ZERO_LANE_ELAPSED=$elapsed $PY - "$timings" <<'PYEOF'
import json, os, subprocess, sys, datetime
import torch
data = json.load(open(sys.argv[1]))
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else "n/a"
lines = [
    "# GPU lane timings (tools/gpu_check.sh)",
    "",
    f"- device: {data['device']} x {data['world_size']} (one rank per GPU, NCCL {nccl})",
    f"- torch {torch.__version__}, CUDA {torch.version.cuda}; commit {commit}; "
    f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
    f"- command: `tools/gpu_check.sh` (pytest exit status {os.environ['ZERO_LANE_STATUS']}, "
    f"{os.environ['ZERO_LANE_ELAPSED']} s)",
    f"- median step time over steps 2..{data['steps']} of tests/test_gpu_lane.py's TinyLM "
    "(a tiny model: launch and communication latency, not throughput)",
    "",
    "| case | median step (ms) |",
    "|---|---|",
]
lines += [f"| {k} | {v * 1e3:.2f} |" for k, v in data["median_step_s"].items()]
path = "tools/bench/results/gpu_lane.md"
tmp = path + ".tmp"
with open(tmp, "w") as f:
    f.write("\n".join(lines) + "\n")
os.replace(tmp, path)
print(f"wrote {path}")
PYEOF
fi
exit "$status"
