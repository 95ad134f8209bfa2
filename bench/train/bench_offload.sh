#!/usr/bin/env bash
# bench/train/bench_offload.sh: training.optimizer_offload (Note [Optimizer offload] in
# worker/train/trainer.hpp) against the same run without it, measured in one run:
#   median step time with / without offload (the ratio is the price of the host update and
#   the two copies a step), the optimizer bytes on the device and on the host (the
#   "event":"memory" line), and on a GPU the peak device memory of each run.
#
#   bench/train/bench_offload.sh [build-dir]   env: CONFIG (configs/bench-cpu.toml), WARMUP (2),
#                                              STEPS (4), ROUNDS (2), EXTRA (more --set ...)
# Rounds alternate the two configurations (background load hits both alike); each figure is
# the median over all timed steps of all rounds.
set -euo pipefail
cd "$(dirname "$0")/../.."
. bench/lib.sh
BUILD=${1:-build}
CONFIG=${CONFIG:-configs/bench-cpu.toml}
WARMUP=${WARMUP:-2}
STEPS=${STEPS:-4}
ROUNDS=${ROUNDS:-2}
bench_tmp
N=$((WARMUP + STEPS))
echo "bench/offload: $CONFIG, warmup $WARMUP, timed $STEPS, rounds $ROUNDS, $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
for round in $(seq "$ROUNDS"); do
  for mode in plain offload; do
    flag=false
    [ "$mode" = offload ] && flag=true
    # shellcheck disable=SC2086
    "$BUILD/bin/dnallm-train" --config "$CONFIG" --set training.max_steps=$N \
      --set training.logging_steps=1 --set checkpoint.save_steps=0 \
      --set checkpoint.save_final=false --set checkpoint.resume=none \
      --set training.optimizer_offload=$flag --log-level warn ${EXTRA:-} \
      --metrics-file "$TMP/$mode.$round.jsonl" > "$TMP/$mode.log" 2>&1 || { cat "$TMP/$mode.log"; exit 1; }
  done
done
python3 - "$TMP" "$WARMUP" "$ROUNDS" <<'PY'
import json, statistics, sys
tmp, warmup, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
out = {}
for mode in ("plain", "offload"):
    steps, memory, summary = [], None, None
    for r in range(1, rounds + 1):
        for line in open(f"{tmp}/{mode}.{r}.jsonl"):
            j = json.loads(line)
            ev = j.get("event")
            if ev is None and j["step"] > warmup:
                steps.append(j["step_s"])
            elif ev == "memory":
                memory = j
            elif ev == "summary":
                summary = j
    out[mode] = (statistics.median(steps), memory, summary)
print(f"{'mode':8} {'median step_s':>13} {'optimizer device MB':>20} {'optimizer host MB':>18} {'peak gpu MB':>12}")
for mode, (step, mem, summ) in out.items():
    print(f"{mode:8} {step:13.4f} {mem['optimizer_device_bytes'] / 1e6:20.1f} "
          f"{mem['optimizer_host_bytes'] / 1e6:18.1f} {summ.get('peak_gpu_mb', float('nan')):12.1f}")
print(f"offload / plain step time: {out['offload'][0] / out['plain'][0]:.3f}x")
PY
