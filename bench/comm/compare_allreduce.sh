#!/usr/bin/env bash
# Allreduce bus bandwidth of our backends next to their peers, measured in one run:
#   dnallm gloo  vs  torch.distributed all_reduce over Gloo (Debian's torch, same libgloo)
#   dnallm mpi   vs  raw MPI_Allreduce (dnallm-bench-comm --backend mpi-raw)
# fp32 sum, sizes MIN..MAX bytes (default 1 MiB..64 MiB), median of ITERS after WARMUP.
# The four sweeps run one after another, REPEAT times (interleaved); each cell shows the
# best of the repeats, which filters out other load on a shared machine.
#
# usage: bench/comm/compare_allreduce.sh [BUILD_DIR]   (env: NP=2 MIN=1048576 MAX=67108864
#                                         ITERS=20 WARMUP=5 REPEAT=3 PORT=29710)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${1:-$here/../../build}
bench=$build/bin/dnallm-bench-comm
np=${NP:-2}
min=${MIN:-1048576}
max=${MAX:-67108864}
iters=${ITERS:-20}
warmup=${WARMUP:-5}
port=${PORT:-29710}
repeat=${REPEAT:-3}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
[[ -x $bench ]] || { echo "no $bench: build first (ninja -C build dnallm-bench-comm)" >&2; exit 2; }
common=(--min-bytes "$min" --max-bytes "$max" --iters "$iters" --warmup "$warmup" --json)

# torchrun-style launch of NP local ranks: run_ranks PORT CMD...
run_ranks() {
  local p=$1; shift
  local pids=()
  for ((r = 0; r < np; r++)); do
    RANK=$r WORLD_SIZE=$np LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$p "$@" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
}
mpi=(mpirun --allow-run-as-root --oversubscribe -np "$np")

echo "# world size $np, fp32 sum allreduce, $iters iterations after $warmup warm-up, best of $repeat, $(date -u +%FT%TZ)"
for ((k = 0; k < repeat; k++)); do
  run_ranks "$((port + 2 * k))" "$bench" --backend gloo "${common[@]}" >> "$out/gloo.jsonl"
  run_ranks "$((port + 2 * k + 1))" /usr/bin/python3 "$here/torch_allreduce.py" --min-bytes "$min" \
    --max-bytes "$max" --iters "$iters" --warmup "$warmup" >> "$out/torch.jsonl"
  "${mpi[@]}" "$bench" --backend mpi "${common[@]}" >> "$out/mpi.jsonl"
  "${mpi[@]}" "$bench" --backend mpi-raw "${common[@]}" >> "$out/mpiraw.jsonl"
done

/usr/bin/python3 - "$out" <<'PY'
import json, os, sys
d = sys.argv[1]
def load(name):
    rows = {}
    for line in open(os.path.join(d, name)):
        line = line.strip()
        if line.startswith("{"):
            j = json.loads(line)
            best = rows.get(j["bytes"])
            if best is None or j["busbw_gbs"] > best["busbw_gbs"]:
                j["wrong"] += best["wrong"] if best else 0
                rows[j["bytes"]] = j
            else:
                best["wrong"] += j["wrong"]
    return rows
g, t, m, r = (load(n) for n in ("gloo.jsonl", "torch.jsonl", "mpi.jsonl", "mpiraw.jsonl"))
hdr = f"{'bytes':>10} {'gloo':>8} {'torch-gloo':>10} {'ratio':>6} {'mpi':>8} {'raw-MPI':>8} {'ratio':>6} {'#wrong':>6}"
print("busbw in GB/s (higher is better); ratio = ours / peer")
print(hdr)
for b in sorted(g):
    bw = lambda rows: rows[b]["busbw_gbs"] if b in rows else float("nan")
    wrong = sum(rows[b]["wrong"] for rows in (g, t, m, r) if b in rows)
    rg = bw(g) / bw(t) if bw(t) else float("nan")
    rm = bw(m) / bw(r) if bw(r) else float("nan")
    print(f"{b:>10} {bw(g):>8.3f} {bw(t):>10.3f} {rg:>6.2f} {bw(m):>8.3f} {bw(r):>8.3f} {rm:>6.2f} {wrong:>6}")
PY
