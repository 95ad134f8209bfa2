#!/usr/bin/env bash
# bench/zero3: sharded data parallelism on configs/bench-cpu.toml, 2 ranks x 1 thread over gloo,
# measured in one run:
#   ours: dnallm-launch --nproc-per-node 2 --set parallel.zero_stage=S for each S in $STAGES
#         (a stage the binary refuses, e.g. 3 before ZeRO-3 lands, is skipped and said so);
#   peer: PyTorch FSDP2 (fully_shard on each block, then the root, as torchtitan does) over
#         gloo, the same model, per-rank micro-batch of 8 x 512 and AdamW, fp32
#         (bench/zero3/torch_fsdp_peer.py; it falls back to DDP, saying why, if fully_shard
#         fails on this torch).
# Reported per run: tokens/s (median step over all timed steps of all rounds), model-state
# bytes on rank 0 (ours: the metrics file's "memory" event, docs/metrics.md; the peer: the
# storages of its parameter shards, gradients and AdamW state) and each rank's peak RSS
# (ours: GNU time's maximum resident set of each dnallm-train, which the launcher runs under
# /usr/bin/time; the peer: VmHWM of each spawned worker). Ratios: ZeRO-3 / peer tokens/s
# (target >= 1.0), ZeRO-3 / ZeRO-2 tokens/s (target >= 0.9), ZeRO-3 / peer memory per rank
# (target <= 1.0); without stage 3, stage 2's ratios against the peer.
#
#   bench/zero3/bench_zero3.sh [--python PATH]... [build-dir]
#   env: WARMUP (2), STEPS (4), ROUNDS (2), STAGES ("2 3"), PYTHON ($DNALLM_PYTHON: the
#        peer's torch), VARIANTS ("sdpa-fused eager": the peer's variants, see
#        bench/train/torch_peer.py; torch.compile is not offered for the FSDP2 peer)
#
# Every configuration runs once per round and rounds alternate, so background load hits all
# alike. A default run (one peer interpreter) took 3 min 19 s under a load of 6 on 2 cores,
# with two --python 5 min 43 s (6 x 2 steps per configuration, plus start-up).
set -euo pipefail
cd "$(dirname "$0")/../.."
. bench/lib.sh
bench_start "$@"
STAGES=${STAGES:-2 3}
VARIANTS=${VARIANTS:-sdpa-fused eager}
WARMUP=${WARMUP:-2}
STEPS=${STEPS:-4}
ROUNDS=${ROUNDS:-2}
bench_tmp
N=$((WARMUP + STEPS))
common=(--config configs/bench-cpu.toml --set training.max_steps="$N" --set training.logging_steps=1
        --set checkpoint.save_final=false --set parallel.backend=gloo --log-level warn)
# Our programs are copied first: a rebuild of $BUILD during the run must not mix two builds.
mkdir "$TMP/bin"
cp "$BUILD/bin/dnallm-launch" "$BUILD/bin/dnallm-train" "$TMP/bin/"
built=$(date -u -r "$BUILD/bin/dnallm-train" '+%F %T UTC')
BIN=$TMP/bin
TIME=/usr/bin/time
"$TIME" -f %M true > /dev/null 2>&1 || TIME=  # GNU time's %M; without it rank 0's summary only
echo "bench/zero3: warmup $WARMUP, timed $STEPS x $ROUNDS rounds, $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "  ours: $BUILD/bin (dnallm-train built $built), stages: $STAGES"
bench_describe_peers
echo "  peer variants: $VARIANTS"
# A stage the launcher refuses to configure is skipped (the reason printed); a stage whose run
# fails is reported and dropped from the later rounds.
run_stages=()
for s in $STAGES; do
  if msg=$("$BIN/dnallm-launch" --nproc-per-node 2 "${common[@]}" \
             --set parallel.zero_stage="$s" --print-config 2>&1 > /dev/null); then
    run_stages+=("$s")
  else
    echo "  ours: zero_stage=$s skipped, the binary refuses it: $(printf '%s' "$msg" | tail -1)"
  fi
done
run_ours() {  # stage
  local s=$1 base="$TMP/z$1.$round"
  local args=("${common[@]}" --set parallel.zero_stage="$s" --metrics-file "$base.jsonl")
  local worker=("$BIN/dnallm-train" "${args[@]}")
  if [ -n "$TIME" ]; then  # one file per rank: $base.rss.$RANK (kB)
    # shellcheck disable=SC2016 # expanded by the worker's bash: RANK is the launcher's
    worker=(bash -c 'exec "$0" -f %M -o "$1.rss.$RANK" "${@:2}"' "$TIME" "$base" "${worker[@]}")
  fi
  OMP_NUM_THREADS=1 "$BIN/dnallm-launch" --nproc-per-node 2 "${args[@]}" -- "${worker[@]}" \
    > "$base.log" 2>&1
}
for round in $(seq "$ROUNDS"); do
  kept=()
  for s in "${run_stages[@]}"; do
    if run_ours "$s"; then
      kept+=("$s")
    else
      echo "bench/zero3: ours zero_stage=$s failed in round $round (dropped):" >&2
      tail -5 "$TMP/z$s.$round.log" >&2
    fi
  done
  run_stages=("${kept[@]}")
  for pi in "${!PYTHONS[@]}"; do
    for v in $VARIANTS; do
      OMP_NUM_THREADS=1 "${PYTHONS[$pi]}" bench/zero3/torch_fsdp_peer.py --world 2 --threads 1 \
        --warmup "$WARMUP" --steps "$STEPS" --variant "$v" --port $((29651 + 2 * pi)) \
        > "$TMP/peer_${pi}_$v.$round.json" 2> "$TMP/peer_${pi}_$v.$round.log" || {
        echo "bench/zero3: peer ${PYTHONS[$pi]} variant $v failed:" >&2
        tail -5 "$TMP/peer_${pi}_$v.$round.log" >&2; }
    done
  done
done
bench_summary "$TMP" "$WARMUP" "$ROUNDS" "$VARIANTS" "${#PYTHONS[@]}" "${run_stages[*]}" <<'PY'
import glob, json, statistics, sys
from summary import peer_runs
tmp, warmup, rounds, variants = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split()
n_py, stages = int(sys.argv[5]), [int(s) for s in sys.argv[6].split()]
MB = 1024 * 1024

def rss_mb(path):  # GNU time -f %M: the last line, kB
    lines = open(path).read().split()
    return int(lines[-1]) / 1024

def ours(s):
    lines = [json.loads(l) for r in range(1, rounds + 1) for l in open(f"{tmp}/z{s}.{r}.jsonl")]
    steps = [l for l in lines if "event" not in l and l["step"] > warmup]
    summary = [l for l in lines if l.get("event") == "summary"]
    mem = [l for l in lines if l.get("event") == "memory"][0]
    world = summary[0]["world_size"]
    step_s = statistics.median(l["step_s"] for l in steps)
    rss = {}
    for p in glob.glob(f"{tmp}/z{s}.*.rss.*"):
        rank = int(p.rsplit(".", 1)[1])
        rss[rank] = max(rss.get(rank, 0), rss_mb(p))
    if not rss:  # no GNU time: rank 0's own getrusage figure
        rss = {0: max(l["peak_rss_mb"] for l in summary)}
    paper = mem["zero_paper_bytes"]
    return {"label": f"dnallm ZeRO-{s}", "step_s": step_s, "tps": world * 8 * 512 / step_s,
            "state": mem["params_bytes"] + mem["grads_bytes"] + mem["optimizer_bytes"],
            "parts": (mem["params_bytes"], mem["grads_bytes"], mem["optimizer_bytes"]),
            "paper": paper["params"] + paper["grads"] + paper["optimizer"],
            "rss": [rss[k] for k in sorted(rss)],
            "rss_summary0": max(l["peak_rss_mb"] for l in summary), "loss": steps[-1]["loss"]}

r = {s: ours(s) for s in stages}
peers = {}
for pi in range(n_py):
    for v in variants:
        runs = peer_runs(f"{tmp}/peer_{pi}_{v}.{q}.json" for q in range(1, rounds + 1))
        if not runs:
            continue
        p0 = runs[0]
        step_s = statistics.median(t for p in runs for t in p["step_s"])
        ranks = p0["ranks"]
        peers[f"{pi}/{v}"] = {
            "label": f"torch {p0['torch']} {'FSDP2' if p0['mode'] == 'fsdp2' else 'DDP'} {v}",
            "step_s": step_s, "tps": p0["world"] * 8 * 512 / step_s,
            "state": ranks[0]["model_state_bytes"],
            "parts": (ranks[0]["params_bytes"], ranks[0]["grads_bytes"], ranks[0]["optimizer_bytes"]),
            "rss": [max(p["ranks"][k]["peak_rss_kb"] for p in runs) / 1024 for k in range(len(ranks))],
            "import_rss": max(p["ranks"][0].get("import_rss_kb", -1) for p in runs) / 1024,
            "errors": sorted({p["fsdp2_error"] for p in runs if p["fsdp2_error"]}),
            "loss": p0["final_loss"]}

print(f"{'run':<36}{'step_s':>8}{'tokens/s':>9}{'state MiB':>10}  {'(params+grads+optim) MiB':<24}"
      f"{'peak RSS MiB per rank':<22}")
for x in list(r.values()) + list(peers.values()):
    parts = "+".join(f"{b / MB:.1f}" for b in x["parts"])
    rss = " / ".join(f"{m:.0f}" for m in x["rss"])
    print(f"{x['label']:<36}{x['step_s']:>8.3f}{x['tps']:>9.0f}{x['state'] / MB:>10.1f}  {parts:<24}{rss:<22}")
for s, x in r.items():
    print(f"  ZeRO-{s}: the ZeRO paper's accounting for the same model {x['paper'] / MB:.1f} MiB;"
          f" rank 0's own peak_rss_mb (summary) {x['rss_summary0']:.0f} MiB; last loss {x['loss']:.3f}")
for k, p in peers.items():
    print(f"  {p['label']}: rank 0's RSS with torch imported, before the model {p['import_rss']:.0f} MiB;"
          f" last loss {p['loss']:.3f}")
    for e in p["errors"]:
        print(f"  {p['label']}: fully_shard FAILED, DDP measured instead: {e}")
if not peers:
    print("no peer measured")
if 3 in r:
    ref, what = r[3], "ZeRO-3"
else:
    ref, what = (r[2], "ZeRO-2") if 2 in r else (None, None)
    print("ZeRO-3 NOT MEASURED (the binary refused or failed parallel.zero_stage=3);"
          + (" ratios below are ZeRO-2's" if ref else " no stage of ours measured"))
if ref:
    for p in peers.values():
        print(f"ratio dnallm {what} / {p['label']} tokens/s: {ref['tps'] / p['tps']:.2f}x (target >= 1.0 for ZeRO-3)")
        print(f"ratio dnallm {what} / {p['label']} memory per rank: model state {ref['state'] / p['state']:.2f},"
              f" peak RSS {max(ref['rss']) / max(p['rss']):.2f} (target <= 1.0 for ZeRO-3)")
if 3 in r and 2 in r:
    print(f"ratio dnallm ZeRO-3 / ZeRO-2 tokens/s: {r[3]['tps'] / r[2]['tps']:.2f}x (target >= 0.90)")
else:
    print("ratio dnallm ZeRO-3 / ZeRO-2: not measured")
PY
