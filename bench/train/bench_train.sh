#!/usr/bin/env bash
# bench/train: dnallm-train vs the same model in PyTorch (torch_peer.py), same run, same
# thread count. The bench-cpu shape (configs/bench-cpu.toml): BERT MLM, char tokens, hidden
# 256, 4 layers, 4 heads, FFN 1024, seq 512, micro-batch 8, fp32, AdamW lr 3e-4, 15% masking.
#
#   bench/train/bench_train.sh [--python PATH]... [path/to/dnallm-train]...
#   env: WARMUP (3), STEPS (5), ROUNDS (2), THREADS (nproc), PYTHON ($DNALLM_PYTHON),
#        VARIANTS ("eager sdpa-fused compile": the peer's variants, see torch_peer.py)
#
# Every dnallm-train given (default build/bin/dnallm-train; two compare a change) and every
# peer variant on every --python (default the project's; a second, e.g. venv-215, puts torch
# 2.15 beside 2.14) run alternately ROUNDS times, so background load hits all alike. The table
# reports, over all timed steps (warm-up steps excluded), the median and the best step time,
# tokens/s = 8 x 512 / median step time, and the first dnallm-train's tokens/s over each row's.
set -euo pipefail
cd "$(dirname "$0")/../.."
. bench/lib.sh
bench_parse_args "$@"
set -- "${ARGS[@]}"
[ $# -gt 0 ] || set -- build/bin/dnallm-train
WARMUP=${WARMUP:-3}
STEPS=${STEPS:-5}
ROUNDS=${ROUNDS:-2}
THREADS=${THREADS:-$(getconf _NPROCESSORS_ONLN)}
VARIANTS=${VARIANTS:-eager sdpa-fused compile}
bench_tmp
export OMP_NUM_THREADS=$THREADS

echo "bench/train: warmup $WARMUP, timed $STEPS x $ROUNDS rounds, threads $THREADS, $(getconf _NPROCESSORS_ONLN) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "  ours: $*"
bench_describe_peers
echo "  peer variants: $VARIANTS"
for r in $(seq "$ROUNDS"); do
  oi=0
  for train in "$@"; do
    "$train" --config configs/bench-cpu.toml --set training.max_steps=$((WARMUP + STEPS)) \
      --set training.logging_steps=1 --set checkpoint.save_final=false \
      --metrics-file "$TMP/ours_${oi}_$r.jsonl" --log-level warn
    echo "$train" > "$TMP/ours_$oi.name"
    oi=$((oi + 1))
  done
  for pi in "${!PYTHONS[@]}"; do
    for v in $VARIANTS; do
      "${PYTHONS[$pi]}" bench/train/torch_peer.py --variant "$v" --warmup "$WARMUP" --steps "$STEPS" \
        --threads "$THREADS" > "$TMP/peer_${pi}_${v}_$r.json" 2> "$TMP/peer_${pi}_${v}_$r.log" || {
        echo "bench/train: peer ${PYTHONS[$pi]} variant $v failed:" >&2; tail -5 "$TMP/peer_${pi}_${v}_$r.log" >&2; }
    done
  done
done
bench_summary "$TMP" "$WARMUP" "$ROUNDS" "$VARIANTS" "$#" "${#PYTHONS[@]}" <<'PY'
import json, statistics, sys
from summary import peer_runs
tmp, warmup, rounds, variants = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split()
n_ours, n_py = int(sys.argv[5]), int(sys.argv[6])
rows = []
for oi in range(n_ours):
    t, loss = [], None
    for r in range(1, rounds + 1):
        lines = [json.loads(l) for l in open(f"{tmp}/ours_{oi}_{r}.jsonl")]
        steps = [l for l in lines if "event" not in l and l["step"] > warmup]
        t += [l["step_s"] for l in steps]
        loss = steps[-1]["loss"]
    name = "dnallm-train" if n_ours == 1 else f"dnallm-train {open(f'{tmp}/ours_{oi}.name').read().strip()}"
    rows.append((name, t, loss))
for pi in range(n_py):
    for v in variants:
        runs = peer_runs(f"{tmp}/peer_{pi}_{v}_{r}.json" for r in range(1, rounds + 1))
        t = [s for p in runs for s in p["step_s"]]
        if t:
            rows.append((f"torch {runs[-1]['torch']} {v}", t, runs[-1]["final_loss"]))
tok = 8 * 512
w = max(len(r[0]) for r in rows) + 2
print(f"{'impl':<{w}}{'steps':>6}{'median_s':>10}{'best_s':>9}{'tokens/s':>10}{'loss':>9}{'ours/this':>10}")
om = statistics.median(rows[0][1])
for i, (name, t, loss) in enumerate(rows):
    m = statistics.median(t)
    ratio = "" if i == 0 else f"{m / om:.2f}x"
    print(f"{name:<{w}}{len(t):>6}{m:>10.3f}{min(t):>9.3f}{tok / m:>10.0f}{loss:>9.4f}{ratio:>10}")
print("ours/this = the first row's tokens/s over this row's, on the medians (above 1: the first row is faster)")
PY
