#!/usr/bin/env bash
# bench/ddp: data-parallel training on configs/bench-cpu.toml, measured in one run:
#   1. dnallm-launch --nproc-per-node 2 vs PyTorch DDP over Gloo (same model, same per-rank
#      micro-batch of 8 x 512, 1 thread per rank): tokens/s ratio (target >= 1.15x);
#   2. scaling: 2 ranks vs 1 rank (1 thread each): efficiency = tps2 / (2 x tps1) (target >= 0.9);
#   3. exposed communication per step (waiting after backward) with overlap (default buckets)
#      vs without (one bucket for the whole model, launched when backward is done);
#   4. accumulate_sync "last" vs "every" with 2 micro-steps.
#
#   bench/ddp/bench_ddp.sh [--python PATH]... [build-dir]
#   env: WARMUP (2), STEPS (4), ROUNDS (2), PYTHON ($DNALLM_PYTHON: the peer's torch),
#        VARIANTS ("eager sdpa-fused compile": the peer's variants, see bench/train/torch_peer.py)
#
# Every configuration runs once per round, rounds alternate (so background load hits all
# alike), and each figure is the median over all timed steps of all rounds.
set -euo pipefail
cd "$(dirname "$0")/../.."
. bench/lib.sh
bench_start "$@"
VARIANTS=${VARIANTS:-eager sdpa-fused compile}
WARMUP=${WARMUP:-2}
STEPS=${STEPS:-4}
ROUNDS=${ROUNDS:-2}
bench_tmp
N=$((WARMUP + STEPS))
common=(--config configs/bench-cpu.toml --set training.max_steps=$N --set training.logging_steps=1
        --set checkpoint.save_final=false --set parallel.backend=gloo --log-level warn)
echo "bench/ddp: warmup $WARMUP, timed $STEPS x $ROUNDS rounds, $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "  ours: $BUILD/bin"
bench_describe_peers
echo "  peer variants: $VARIANTS"
run_ours() {  # name nproc extra...
  local name=$1 n=$2; shift 2
  OMP_NUM_THREADS=1 "$BUILD/bin/dnallm-launch" --nproc-per-node "$n" "${common[@]}" \
    --metrics-file "$TMP/$name.$round.jsonl" "$@" > "$TMP/$name.log" 2>&1 || { cat "$TMP/$name.log"; exit 1; }
}
for round in $(seq "$ROUNDS"); do
  run_ours ddp2 2
  run_ours one 1
  run_ours noov 2 --set parallel.bucket_cap_mb=10000 --set parallel.first_bucket_mb=10000
  run_ours last 2 --set training.micro_batch_size=4 --set training.grad_accum_steps=2 --set parallel.accumulate_sync=last
  run_ours every 2 --set training.micro_batch_size=4 --set training.grad_accum_steps=2 --set parallel.accumulate_sync=every
  for pi in "${!PYTHONS[@]}"; do
    for v in $VARIANTS; do
      OMP_NUM_THREADS=1 "${PYTHONS[$pi]}" bench/ddp/torch_ddp_peer.py --world 2 --threads 1 \
        --warmup "$WARMUP" --steps "$STEPS" --variant "$v" > "$TMP/peer_${pi}_$v.$round.json" \
        2> "$TMP/peer_${pi}_$v.$round.log" || {
        echo "bench/ddp: peer ${PYTHONS[$pi]} variant $v failed:" >&2; tail -5 "$TMP/peer_${pi}_$v.$round.log" >&2; }
    done
  done
done
bench_summary "$TMP" "$WARMUP" "$ROUNDS" "$VARIANTS" "${#PYTHONS[@]}" <<'PY'
import json, statistics, sys
from summary import peer_runs
tmp, warmup, rounds, variants = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split()
n_py = int(sys.argv[5])
def ours(name):
    lines = [json.loads(l) for r in range(1, rounds + 1) for l in open(f"{tmp}/{name}.{r}.jsonl")]
    steps = [l for l in lines if "event" not in l and l["step"] > warmup]
    world = [l for l in lines if l.get("event") == "summary"][0]["world_size"]
    step_s = statistics.median(l["step_s"] for l in steps)
    exposed = statistics.median(l["comm_exposed_s"] for l in steps)
    return {"step_s": step_s, "tps": world * 8 * 512 / step_s, "exposed": exposed, "loss": steps[-1]["loss"]}
r = {k: ours(k) for k in ["ddp2", "one", "noov", "last", "every"]}
peers = {}
for pi in range(n_py):
    for v in variants:
        runs = peer_runs(f"{tmp}/peer_{pi}_{v}.{r}.json" for r in range(1, rounds + 1))
        if runs:
            steps = [t for p in runs for t in p["step_s"]]
            peers[f"{runs[0]['torch']} {v}"] = dict(
                runs[0], step_s_median=statistics.median(steps),
                tokens_per_s=runs[0]["world"] * 8 * 512 / statistics.median(steps))
print(f"{'run':<40}{'step_s':>9}{'tokens/s':>10}{'exposed_s':>11}")
for name, label in [("ddp2", "dnallm 2 ranks (overlap)"), ("noov", "dnallm 2 ranks (no overlap)"),
                    ("one", "dnallm 1 rank"), ("last", "dnallm 2 ranks accum=2 last"),
                    ("every", "dnallm 2 ranks accum=2 every")]:
    x = r[name]
    print(f"{label:<40}{x['step_s']:>9.3f}{x['tps']:>10.0f}{x['exposed']:>11.4f}")
for v, peer in peers.items():
    label = f"torch {v} DDP"
    print(f"{label:<40}{peer['step_s_median']:>9.3f}{peer['tokens_per_s']:>10.0f}{'-':>11}")
for v, peer in peers.items():
    print(f"ratio dnallm 2 ranks / torch DDP {v} tokens/s: {r['ddp2']['tps'] / peer['tokens_per_s']:.2f}x"
          " (target >= 1.15)")
print(f"scaling efficiency 2 ranks vs 1: {r['ddp2']['tps'] / (2 * r['one']['tps']):.2f} (target >= 0.9)")
print(f"exposed comm per step: overlap {r['ddp2']['exposed']:.4f} s vs no overlap {r['noov']['exposed']:.4f} s")
print(f"accumulation: last {r['last']['tps']:.0f} tok/s vs every {r['every']['tps']:.0f} tok/s")
PY
