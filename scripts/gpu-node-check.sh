#!/usr/bin/env bash
# Proves the GPU path on a fresh GPU node in one invocation (about 8 minutes on one H100
# with 16 cores): from a clone plus the tarball of scripts/stage-gpu-deps.sh,
#   1. builds the CUDA flavour (scripts/build.sh --cuda, only the targets needed here), checks
#      that the programs load the CUDA plugin for a GPU run (Note [Lazy CUDA]),
#   2. runs the GPU tests (ctest -L gpu: staged collectives, NCCL at world size 1 through
#      dnallm-train, 2 ranks sharing the GPU over staged gloo vs 1 rank, too many ranks),
#   3. NCCL through dnallm-bench-comm at world size 1,
#   4. a first bf16 training run of configs/dnabert-mlm.toml (the README's command),
#   5. 2 ranks sharing the GPU (parallel.share_gpus) vs 1 rank, and the too-many-ranks exit,
#   6. the bench/gpu table against Hugging Face,
#   7. checkpoints on the GPU: the training thread's stall per save, steps after a resume
#      against fresh steps, and a save after the resume (it must commit),
#   8. dnallm-infer embed on the GPU against Hugging Face's AutoModel on the same export,
#   9. ZeRO-3 bf16 against DDP on the device: tokens/s and the allocator's peak.
# Every result goes under OUTDIR (summary.txt first); a failing step is recorded and the
# next one runs anyway. Exit status: 0 when every step passed, else 1.
#
#   scripts/gpu-node-check.sh OUTDIR [--deps-tarball FILE | --deps PREFIX] [--skip-bench]
#   env: DNALLM_JOBS (nproc), BENCH_STEPS (100), PYTHON (python3)
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
[ $# -ge 1 ] || { sed -n '2,17p' "$0"; exit 2; }
out="$(mkdir -p "$1" && cd "$1" && pwd)"; shift
deps=""
tarball=""
bench=1
while [ $# -gt 0 ]; do
  case "$1" in
    --deps) deps="$2"; shift 2 ;;
    --deps-tarball) tarball="$2"; shift 2 ;;
    --skip-bench) bench=0; shift ;;
    *) echo "gpu-node-check.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
export DNALLM_JOBS="${DNALLM_JOBS:-$(nproc)}"
build="${DNALLM_BUILD_DIR:-$root/build-cuda}"
export DNALLM_BUILD_DIR="$build"
bin="$build/bin"
summary="$out/summary.txt"
: > "$summary"
failed=0
t_start=$(date +%s)

# step NAME COMMAND...: runs it with its output in OUTDIR/NAME.log, records the outcome.
step() {
  local name=$1; shift
  local t0=$(date +%s) rc=0
  echo "== $name: $*" | tee -a "$out/$name.log" >/dev/null
  (cd "$root" && "$@") >> "$out/$name.log" 2>&1 || rc=$?
  local verdict=PASS
  [ $rc -eq 0 ] || { verdict="FAIL (exit $rc)"; failed=1; }
  printf '%-28s %-16s %4ss  %s\n' "$name" "$verdict" $(( $(date +%s) - t0 )) "$name.log" | tee -a "$summary"
  return 0
}

# gpu_step NAME COMMAND...: step, or a recorded skip where no GPU is visible.
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
gpu_step() {
  if [ "${gpus:-0}" -gt 0 ]; then step "$@"; return 0; fi
  printf '%-28s %-16s %4ss  %s\n' "$1" "SKIP (no GPU)" 0 "nvidia-smi -L lists none" | tee -a "$summary"
}

{
  echo "dnallm-dist GPU node check, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git -C "$root" rev-parse --short HEAD 2>/dev/null)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  "${PYTHON:-python3}" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>/dev/null
  echo "cores $(nproc), jobs $DNALLM_JOBS"
} | tee -a "$summary"

if [ -n "$tarball" ]; then
  mkdir -p "$out/deps"
  step unpack-deps tar xzf "$tarball" -C "$out/deps"
  deps="$out/deps/prefix"
fi

# 1. Build: the binaries and the GPU tests only.
# Every target with tests labelled gpu: a test executable not built registers no tests, and
# ctest -L gpu then silently runs fewer (worker_gpu_test was missing until 2026-11-27).
targets=(dnallm-train dnallm-launch dnallm-bench-comm dnallm-eval dnallm-infer dnallm_cuda worker_device_group_test
         worker_gpu_test integration_gpu_train_test cluster_test)
targs=()
for t in "${targets[@]}"; do targs+=(--target "$t"); done
step build scripts/build.sh --cuda ${deps:+--deps "$deps"} "${targs[@]}"
grep -E "LibTorch|backend|torch-include-shadow|bundles fmt" "$out/build.log" | head -8 >> "$summary"

# 1b. Note [Lazy CUDA]: the programs need LibTorch's CPU half only, the plugin the CUDA half,
# and a run with training.device = "auto" loads the plugin and trains on cuda:0.
lazy_cuda() {
  local rc=0
  for exe in dnallm-train dnallm-infer dnallm-eval; do
    if readelf -d "$bin/$exe" | grep -E "NEEDED.*(libtorch_cuda|libnccl|libcudart)"; then
      echo "$exe needs the CUDA half: it belongs in libdnallm_cuda.so"; rc=1
    fi
  done
  readelf -d "$bin/libdnallm_cuda.so" | grep -E "NEEDED.*(libtorch_cuda|libnccl)" || rc=1
  if [ "${gpus:-0}" -gt 0 ]; then
    "$bin/dnallm-train" --config configs/gpt.toml --set model.hidden=64 --set model.layers=2 \
      --set model.heads=2 --set model.ffn=128 --set model.max_seq_length=128 \
      --set training.max_steps=2 --set training.eval_steps=0 --set checkpoint.save_steps=0 \
      --set checkpoint.save_final=false --set training.device=auto \
      --set checkpoint.dir="$out/lazy-cuda/ckpt" 2>&1 | tee "$out/lazy-cuda.txt"
    grep -q "device cuda:0" "$out/lazy-cuda.txt" || { echo "auto did not pick cuda:0"; rc=1; }
  fi
  return $rc
}
step lazy-cuda-plugin lazy_cuda
grep -m1 "device cuda" "$out/lazy-cuda.txt" >> "$summary" 2>/dev/null

# 2. GPU tests (each skips itself with a reason where it cannot run).
step ctest-gpu ctest --test-dir "$build" -L gpu --output-on-failure --timeout 600 --no-tests=error
grep -E "tests passed|Skipped|\*\*\*Failed|Not Run" "$out/ctest-gpu.log" | head -20 >> "$summary"

# 3. NCCL through the comm bench at world size 1.
gpu_step bench-comm-nccl "$bin/dnallm-bench-comm" --backend nccl --op allreduce --min-bytes 1024 \
  --max-bytes 268435456 --iters 20 --warmup 5
tail -3 "$out/bench-comm-nccl.log" >> "$summary" 2>/dev/null

# 4. A first bf16 training run (README "GPU nodes").
gpu_step first-bf16-run "$bin/dnallm-train" --config configs/dnabert-mlm.toml \
  --set training.max_steps=40 --set training.logging_steps=10 --set training.eval_steps=0 \
  --set checkpoint.save_steps=0 --set checkpoint.dir="$out/first-run/ckpt" \
  --set checkpoint.resume=none --metrics-file "$out/first-run/metrics.jsonl"
tail -2 "$out/first-run/metrics.jsonl" >> "$summary" 2>/dev/null

# 5. One GPU per rank, by hand: 2 ranks sharing the GPU vs 1 rank, and too many ranks.
tiny=(--config configs/dnabert-mlm.toml --set model.hidden=128 --set model.layers=2
      --set model.heads=2 --set model.ffn=256 --set model.max_seq_length=128
      --set model.dropout=0 --set training.precision=fp32 --set training.max_steps=20
      --set training.logging_steps=1 --set training.eval_steps=0 --set training.warmup_ratio=0
      --set training.device=cuda --set checkpoint.save_steps=0 --set checkpoint.save_final=false
      --set checkpoint.resume=none --set data.dataloader_num_workers=1)
gpu_step one-rank "$bin/dnallm-train" "${tiny[@]}" --set training.micro_batch_size=8 \
  --set training.grad_accum_steps=1 --set checkpoint.dir="$out/one/ckpt" \
  --metrics-file "$out/one/metrics.jsonl"
gpu_step two-ranks-shared-gpu "$bin/dnallm-launch" --nproc-per-node 2 -- "$bin/dnallm-train" \
  "${tiny[@]}" --set training.micro_batch_size=4 --set training.grad_accum_steps=1 \
  --set parallel.share_gpus=true --set checkpoint.dir="$out/two/ckpt" \
  --metrics-file "$out/two/metrics.jsonl"
gpu_step compare-one-two "${PYTHON:-python3}" - "$out/one/metrics.jsonl" "$out/two/metrics.jsonl" <<'PY'
import json, sys
def losses(p):
    return {j["step"]: j["loss"] for j in map(json.loads, open(p)) if "event" not in j}
a, b = losses(sys.argv[1]), losses(sys.argv[2])
worst = max(abs(a[s] - b[s]) / abs(a[s]) for s in a)
for s in sorted(a):
    print(f"step {s:3d}  1 rank {a[s]:.6f}  2 ranks sharing the GPU {b[s]:.6f}")
print(f"largest relative loss difference over {len(a)} steps: {worst:.2e}")
sys.exit(0 if len(a) == len(b) == 20 and worst < 1e-3 else 1)
PY
tail -1 "$out/compare-one-two.log" >> "$summary" 2>/dev/null
too_many_ranks() {
  local rc=0
  "$bin/dnallm-launch" --nproc-per-node $((gpus + 1)) -- "$bin/dnallm-train" "${tiny[@]}" \
    --set checkpoint.dir="$out/toomany/ckpt" || rc=$?
  echo "exit code $rc with $((gpus + 1)) ranks on $gpus GPU(s) (expected 2)"
  [ $rc -eq 2 ]
}
gpu_step too-many-ranks too_many_ranks
grep -m1 "ranks on this node" "$out/too-many-ranks.log" >> "$summary" 2>/dev/null

# 6. Throughput against Hugging Face.
if [ "$bench" = 1 ]; then
  gpu_step bench-gpu bench/gpu/bench_gpu.sh --bin "$bin" --out "$out/bench" \
    --steps "${BENCH_STEPS:-100}" --warmup 20
  [ -f "$out/bench/table.txt" ] && cat "$out/bench/table.txt" >> "$summary"
fi

# 7. Checkpoints on the GPU (configs/dnabert-mlm.toml at micro-batch 64): saves at 20, 40, 60
# (stall per save), then a resume from 60 to 100 saving at 80 and 100 (resumed step time vs
# fresh, and a save after a resume that must commit).
ckpt_run=(--config configs/dnabert-mlm.toml --set training.micro_batch_size=64
          --set training.logging_steps=1 --set training.eval_steps=0
          --set checkpoint.save_steps=20 --set checkpoint.keep_last=5
          --set checkpoint.dir="$out/ckpt/ckpt" --metrics-file "$out/ckpt/metrics.jsonl")
gpu_step ckpt-fresh "$bin/dnallm-train" "${ckpt_run[@]}" --set training.max_steps=60 \
  --set checkpoint.resume=none
gpu_step ckpt-resumed "$bin/dnallm-train" "${ckpt_run[@]}" --set training.max_steps=100 \
  --set checkpoint.resume=auto
gpu_step ckpt-summary "${PYTHON:-python3}" - "$out/ckpt/metrics.jsonl" "$out/ckpt/ckpt" <<'PY'
import json, os, statistics, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
steps = {j["step"]: j["step_s"] for j in lines if "event" not in j and "step_s" in j}
saves = [j for j in lines if j.get("event") == "checkpoint"]
fresh = [steps[s] for s in range(5, 61) if s in steps and s % 20 not in (0, 1)]
resumed = [steps[s] for s in range(66, 101) if s in steps and s % 20 not in (0, 1)]
for j in saves:
    print(f"save at step {j['step']}: training thread stalled {j.get('stall_s', -1):.3f} s, "
          f"written in {j.get('write_s', -1):.2f} s, {j.get('bytes', 0) / 1e6:.0f} MB")
mf, mr = statistics.median(fresh), statistics.median(resumed)
print(f"median step: fresh {mf:.4f} s, after the resume {mr:.4f} s (resumed / fresh {mr / mf:.2f}x)")
after = [j for j in saves if j["step"] > 60]
committed = [s for s in (80, 100)
             if os.path.exists(os.path.join(sys.argv[2], f"step_{s:09d}", "manifest.json"))]
print(f"saves after the resume: {len(after)} logged, committed steps {committed}")
sys.exit(0 if committed == [80, 100] and mr < 1.5 * mf else 1)
PY
cat "$out/ckpt-summary.log" | grep -v '^==' >> "$summary" 2>/dev/null

# 8. Embeddings on the GPU: dnallm-infer embed against transformers' AutoModel on our export.
if [ "$bench" = 1 ]; then
  gpu_step embed-vs-hf bench/gpu/bench_embed_gpu.sh --bin "$bin" --out "$out/embed"
  [ -f "$out/embed/table.txt" ] && cat "$out/embed/table.txt" >> "$summary"
fi

# 9. ZeRO-3 bf16 on the device against DDP in the same setting (configs/dnabert-mlm.toml at
# micro-batch 16, 30 steps): median tokens/s after 5 warm-up steps and the allocator's peak.
# NCCL takes one GPU per rank (it refuses two ranks on one device; parallel.backend = "nccl"
# with share_gpus is a usage error), so on one GPU:
#  - nccl at world size 1: ZeRO-3's stream-ordered path (Note [Fully sharded stream order]),
#    every gather and reduction a real NCCL collective on its own stream, with nothing on the
#    wire: what the machinery costs on the device, not the overlap of a real exchange;
#  - 2 ranks sharing the GPU over staged gloo: a real exchange, through host memory, which
#    waits on the host.
# With 2+ GPUs the ranks are the GPUs over nccl instead of the second pair.
z3_run() {  # LABEL RANKS ZERO_STAGE CONFIG_FLAGS...
  local label=$1 ranks=$2 stage=$3; shift 3
  "$bin/dnallm-launch" --nproc-per-node "$ranks" -- "$bin/dnallm-train" \
    --config configs/dnabert-mlm.toml --set training.micro_batch_size=16 \
    --set training.max_steps=30 --set training.logging_steps=1 --set training.eval_steps=0 \
    --set training.precision=bf16 --set parallel.zero_stage="$stage" "$@" \
    --set checkpoint.save_steps=0 --set checkpoint.save_final=false --set checkpoint.resume=none \
    --set checkpoint.dir="$out/zero3/ckpt-$label" --metrics-file "$out/zero3/$label.jsonl"
}
mkdir -p "$out/zero3"
z3_labels=(zero3-nccl-1 ddp-nccl-1)
gpu_step zero3-nccl-1 z3_run zero3-nccl-1 1 3 --set parallel.backend=nccl
gpu_step ddp-nccl-1 z3_run ddp-nccl-1 1 0 --set parallel.backend=nccl
if [ "${gpus:-0}" -ge 2 ]; then
  z3_labels+=(zero3-nccl-$gpus ddp-nccl-$gpus)
  gpu_step zero3-nccl-$gpus z3_run zero3-nccl-$gpus "$gpus" 3 --set parallel.backend=nccl
  gpu_step ddp-nccl-$gpus z3_run ddp-nccl-$gpus "$gpus" 0 --set parallel.backend=nccl
else
  z3_labels+=(zero3-gloo-2-shared ddp-gloo-2-shared)
  gpu_step zero3-gloo-2-shared z3_run zero3-gloo-2-shared 2 3 --set parallel.share_gpus=true
  gpu_step ddp-gloo-2-shared z3_run ddp-gloo-2-shared 2 0 --set parallel.share_gpus=true
fi
gpu_step zero3-summary "${PYTHON:-python3}" - "$out/zero3" "${z3_labels[@]}" <<'PY'
import json, os, statistics, sys
def run(label):
    p = os.path.join(sys.argv[1], f"{label}.jsonl")
    if not os.path.exists(p):
        return None
    lines = [json.loads(l) for l in open(p)]
    steps = [j for j in lines if "event" not in j and "tokens_per_s" in j]
    summary = next((j for j in lines if j.get("event") == "summary"), {})
    late = [j["tokens_per_s"] for j in steps if j["step"] > 5]
    return len(steps), statistics.median(late) if late else 0.0, summary
results = {label: run(label) for label in sys.argv[2:]}
print("ZeRO-3 bf16 vs DDP on the device (dnabert-mlm, micro-batch 16, median of steps 6-30):")
for label, r in results.items():
    if r is None:
        print(f"  {label:22s} no metrics"); continue
    n, tps, s = r
    print(f"  {label:22s} {n:2d} steps  {tps:10,.0f} tokens/s  peak allocated "
          f"{s.get('peak_gpu_mb', -1):8,.0f} MiB (reserved {s.get('peak_gpu_reserved_mb', -1):,.0f})"
          f"  model state peak {s.get('model_state_peak_bytes', 0) / 2**20:,.0f} MiB")
ok = True
for z, d in zip(sys.argv[2::2], sys.argv[3::2]):
    if results[z] and results[d] and results[d][1] > 0:
        print(f"  {z} / {d} tokens/s: {results[z][1] / results[d][1]:.2f}x")
    ok = ok and results[z] is not None and results[z][0] == 30
sys.exit(0 if ok else 1)
PY
grep -v '^==' "$out/zero3-summary.log" >> "$summary" 2>/dev/null

echo "total $(( $(date +%s) - t_start ))s; $( [ $failed -eq 0 ] && echo 'all steps passed' || echo 'some steps FAILED')" | tee -a "$summary"
exit $failed
