#!/usr/bin/env bash
# bench/context_parallel: HyenaDNA context parallelism on the CPU (Note [Data x context mesh]).
# A HyenaDNA-shaped model (configs/hyenadna-tiny-32k.toml: 2 Hyena blocks, activation
# checkpointing, fp32, one sequence a step) made narrow (model.hidden = $D_MODEL) so that it
# runs on a small CPU in minutes, trained for $STEPS steps through dnallm-launch at each
# sequence length of $LENGTHS and each context-parallel degree of $DEGREES (world = C: one
# sequence split over C ranks). Threads: $CORES in all (OMP_NUM_THREADS = CORES / C a rank), so
# every configuration has the same compute and tokens/s compares the work, not the cores.
# Reported per (C, length): tokens/s (median step after the first) and each rank's peak RSS
# (GNU time's maximum resident set of each dnallm-train; without it rank 0's summary). Then, in
# the same run: C > 1 against C = 1 at $TARGET tokens (peak RSS and tokens/s ratios), and the
# longest measured length whose largest per-rank peak RSS fits $BUDGET_MB for each C (default
# budget: C = 1's peak at $TARGET; it should grow about linearly with C). That longest length is
# then refined for each C by bisection between it and the next length of the grid, to a
# multiple of $REFINE_STEP (0: no refinement; needs GNU time).
#
#   bench/context_parallel/bench_context_parallel.sh [build-dir]
#   env: LENGTHS ("65536 131072 262144 524288"), DEGREES ("1 2 4"), TARGET (262144), STEPS (3),
#        D_MODEL (16), CORES (nproc), BUDGET_MB (C = 1's peak at TARGET), REFINE_STEP (32768)
# A length whose run fails (e.g. out of memory) is reported and counts as not fitting.
set -euo pipefail
cd "$(dirname "$0")/../.."
. bench/lib.sh
BUILD=${1:-build}
LENGTHS=${LENGTHS:-65536 131072 262144 524288}
DEGREES=${DEGREES:-1 2 4}
TARGET=${TARGET:-262144}
STEPS=${STEPS:-3}
D_MODEL=${D_MODEL:-16}
CORES=${CORES:-$(nproc)}
BUDGET_MB=${BUDGET_MB:-}
REFINE_STEP=${REFINE_STEP:-32768}
bench_tmp
# Our programs are copied first: a rebuild of $BUILD during the run must not mix two builds.
mkdir "$TMP/bin"
cp "$BUILD/bin/dnallm-launch" "$BUILD/bin/dnallm-train" "$TMP/bin/"
BIN=$TMP/bin
TIME=/usr/bin/time
"$TIME" -f %M true > /dev/null 2>&1 || TIME=
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"  # see bench/hyena/long_context.sh
# glibc raises its mmap threshold up to 32 MiB as big blocks are freed, after which a tensor
# under it comes from the heap and its pages stay resident when freed: C = 2 and 4 shards
# (tensors of L / C positions) fell under it where C = 1's did not, which inflated their peak
# RSS. A fixed threshold gives every configuration the same allocator behaviour. (That is for a
# build with DNALLM_WITH_TCMALLOC=OFF: by default our programs allocate with tcmalloc, Note [CPU
# allocator], whose free spans stay resident, so a peak RSS includes what tcmalloc keeps.)
export MALLOC_MMAP_THRESHOLD_="${MALLOC_MMAP_THRESHOLD_:-1048576}"
echo "bench/context_parallel: d_model $D_MODEL, 2 layers, $STEPS steps, lengths $LENGTHS," \
  "degrees $DEGREES, $CORES threads in all, $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
run() {  # run C LENGTH: one configuration; its files are $TMP/c$C.l$LENGTH.*
  local c=$1 len=$2
  local base="$TMP/c$c.l$len"
  args=(--config configs/hyenadna-tiny-32k.toml --set model.hidden="$D_MODEL"
        --set model.ffn=$((4 * D_MODEL)) --set model.max_seq_length="$len"
        --set training.max_steps="$STEPS" --set training.grad_accum_steps=1
        --set training.micro_batch_size=1 --set training.eval_steps=0
        --set training.logging_steps=1 --set data.eval_fraction=0
        --set checkpoint.save_steps=0 --set checkpoint.save_final=false
        --set checkpoint.dir="$TMP/ckpt.c$c.l$len" --set parallel.backend=gloo
        --set parallel.context_parallel="$c" --log-level warn --metrics-file "$base.jsonl")
  worker=("$BIN/dnallm-train" "${args[@]}")
  if [ -n "$TIME" ]; then  # one file per rank: $base.rss.$RANK (kB)
    # shellcheck disable=SC2016 # expanded by the worker's bash: RANK is the launcher's
    worker=(bash -c 'exec "$0" -f %M -o "$1.rss.$RANK" "${@:2}"' "$TIME" "$base" "${worker[@]}")
  fi
  start=$(date +%s)
  if OMP_NUM_THREADS=$((CORES / c > 0 ? CORES / c : 1)) "$BIN/dnallm-launch" \
       --nproc-per-node "$c" "${args[@]}" -- "${worker[@]}" > "$base.log" 2>&1; then
    echo "  C=$c length $len: done in $(( $(date +%s) - start )) s"
  else
    echo "  C=$c length $len: FAILED ($(tail -1 "$base.log"))"
    touch "$base.failed"
  fi
}
for c in $DEGREES; do
  for len in $LENGTHS; do run "$c" "$len"; done
done
# The largest peak RSS of a rank, in whole MiB (rounded; failed or unmeasured: none). The
# summary below rounds the same way, so that C = 1 at $TARGET fits its own budget.
peak_mib() {
  [ -e "$TMP/c$1.l$2.failed" ] && return 0
  cat "$TMP/c$1.l$2".rss.* 2> /dev/null | sort -n | tail -1 | awk '{ printf "%d", $1 / 1024 + 0.5 }'
}
budget=${BUDGET_MB:-$(peak_mib 1 "$TARGET")}
if [ -n "$TIME" ] && [ "$REFINE_STEP" -gt 0 ] && [ -n "$budget" ]; then
  echo "refining the longest length within $budget MiB a rank (steps of $REFINE_STEP):"
  for c in $DEGREES; do
    lo=0 hi=0
    for len in $LENGTHS; do
      m=$(peak_mib "$c" "$len")
      if [ -n "$m" ] && [ "$m" -le "$budget" ]; then lo=$len; elif [ "$hi" = 0 ] && [ "$len" -gt "$lo" ]; then hi=$len; fi
    done
    while [ "$lo" -gt 0 ] && [ "$hi" -gt 0 ] && [ $((hi - lo)) -gt "$REFINE_STEP" ]; do
      mid=$(( (lo + hi) / 2 / REFINE_STEP * REFINE_STEP ))
      [ "$mid" -le "$lo" ] && break
      run "$c" "$mid"
      m=$(peak_mib "$c" "$mid")
      if [ -n "$m" ] && [ "$m" -le "$budget" ]; then lo=$mid; else hi=$mid; fi
    done
  done
fi
python3 - "$TMP" "$TARGET" "$budget" "$DEGREES" <<'PY'
import glob, json, os, re, statistics, sys
tmp, target, budget = sys.argv[1], int(sys.argv[2]), sys.argv[3]
degrees = [int(c) for c in sys.argv[4].split()]
# Every length run (the grid's and the refinement's).
lengths = sorted({int(re.search(r"\.l(\d+)\.log$", p).group(1)) for p in glob.glob(tmp + "/c*.log")})

def result(c, n):
    base = f"{tmp}/c{c}.l{n}"
    if os.path.exists(base + ".failed") or not os.path.exists(base + ".jsonl"):
        return None
    lines = [json.loads(l) for l in open(base + ".jsonl")]
    steps = [l for l in lines if "event" not in l]
    summary = [l for l in lines if l.get("event") == "summary"]
    step_s = statistics.median(l["step_s"] for l in steps[1:] or steps)
    rss = [int(open(p).read().split()[-1]) / 1024 for p in sorted(glob.glob(base + ".rss.*"))]
    if not rss:
        rss = [summary[0]["peak_rss_mb"]]
    return {"tps": n / step_s, "step_s": step_s, "rss": rss, "loss": steps[-1]["loss"]}

r = {(c, n): result(c, n) for c in degrees for n in lengths
     if os.path.exists(f"{tmp}/c{c}.l{n}.log")}
print(f"{'C':>2} {'length':>8} {'step_s':>8} {'tokens/s':>9} {'peak RSS a rank (MiB)':>24} {'loss':>7}")
for (c, n), x in sorted(r.items()):
    if x is None:
        print(f"{c:>2} {n:>8} {'failed':>8}")
        continue
    print(f"{c:>2} {n:>8} {x['step_s']:>8.2f} {x['tps']:>9.0f} "
          f"{' '.join(f'{v:.0f}' for v in x['rss']):>24} {x['loss']:>7.4f}")
one = r.get((1, target))
for c in degrees:
    x = r.get((c, target))
    if c == 1 or x is None or one is None:
        continue
    print(f"at {target} tokens, C={c} / C=1: peak RSS a rank {max(x['rss']) / max(one['rss']):.2f}x, "
          f"tokens/s {x['tps'] / one['tps']:.2f}x")
if not budget:
    budget = max(one["rss"]) if one else 0
budget = float(budget)
print(f"budget {budget:.0f} MiB a rank: longest measured length that fits")
for c in degrees:
    fit = [n for n in lengths if r.get((c, n)) and round(max(r[(c, n)]["rss"])) <= budget]
    print(f"  C={c}: {max(fit) if fit else 'none'}")
PY
