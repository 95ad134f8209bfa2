"""What Note [Buddy copies] costs a ZeRO run (worker/train/in_process_recovery.hpp): the same
job with and without warm spares. With `--spare-workers 1` every rank copies its shard
(parameters and both Adam moments) to the host after each step, sends it to the next rank and
joins a barrier; without spares it does none of that. The peer is the same job without
spares, measured in the same run.

Step time: rank 0's metrics lines are polled every millisecond; the wall time from the line of
step --skip to the last one, over the steps between (evaluation off, checkpoints off: a step's
hooks included, as `step_s` does not). Memory: the copies' host bytes, 48 x P / world for P
trainable parameters (two steps' slots, own and the predecessor's), against the model state
rank 0's memory event reports (parameters, gradients, optimizer state).

    buddy_cost.py --launch build/bin/dnallm-launch [--zero 1] [--hidden 256] [--layers 4]
                  [--steps 60] [--nproc 2] [--repeats 2]
Prints one line per run and the ratio spare / plain; exit 1 when a run fails.
"""
import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.dirname(os.path.dirname(HERE))


def step_times(cmd, env, metrics, steps, limit_s=600):
    """Runs `cmd`; returns ({step: arrival time}, the memory event of rank 0)."""
    seen, memory = {}, None
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    start = time.monotonic()
    offset = 0
    while True:
        try:
            with open(metrics) as f:
                f.seek(offset)
                chunk = f.read()
        except FileNotFoundError:
            chunk = ""
        now = time.monotonic()
        done = chunk.rfind("\n") + 1
        for line in chunk[:done].splitlines():
            j = json.loads(line)
            if "event" not in j and "step" in j:
                seen.setdefault(j["step"], now)
            elif j.get("event") == "memory" and j.get("rank") == 0:
                memory = j
        offset += done
        if proc.poll() is not None and not chunk:
            break
        if now - start > limit_s:
            proc.kill()
            raise RuntimeError(f"{cmd[0]} did not finish in {limit_s} s")
        time.sleep(0.001)
    if proc.returncode != 0:
        raise RuntimeError(f"the run failed ({proc.returncode}): {proc.stderr.read()[-2000:]}")
    if len(seen) < steps:
        raise RuntimeError(f"{len(seen)} of {steps} step lines")
    return seen, memory


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--launch", default=os.path.join(SRC, "build/bin/dnallm-launch"))
    p.add_argument("--zero", type=int, default=1, choices=[1, 2, 3])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--skip", type=int, default=10, help="steps left out at the start")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="dnallm-bench-buddy-")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("DNALLM_JOB_TOKEN", None)
    sets = [f"model.hidden={a.hidden}", f"model.layers={a.layers}", "model.heads=4",
            f"model.ffn={4 * a.hidden}", "model.max_seq_length=128",
            f'data.train_files=["{SRC}/data/ecoli_k12_mg1655.fa.gz"]',
            f"training.max_steps={a.steps}", "training.micro_batch_size=4",
            "training.logging_steps=1", "training.seed=7", "data.dataloader_num_workers=1",
            "parallel.backend=gloo", f"parallel.zero_stage={a.zero}",
            "checkpoint.save_steps=0", "checkpoint.save_final=false", "logging.level=warn"]
    print(f"bench/elastic/buddy_cost: ZeRO-{a.zero}, {a.nproc} ranks, hidden {a.hidden}, "
          f"{a.layers} layers, {a.steps} steps, {os.cpu_count()} cores, load "
          f"{open('/proc/loadavg').read().split()[:3]}", flush=True)
    per_step = {"plain": [], "spare": []}
    params = state = None
    for r in range(a.repeats):
        for name in ("plain", "spare"):
            metrics = f"{tmp}/{name}{r}.jsonl"
            cmd = [a.launch, "--standalone", "--nproc-per-node", str(a.nproc), "--max-restarts",
                   "0", "--metrics-file", metrics, "--set", f"checkpoint.dir={tmp}/{name}{r}"]
            if name == "spare":
                cmd += ["--spare-workers", "1"]
            for s in sets:
                cmd += ["--set", s]
            seen, memory = step_times(cmd, env, metrics, a.steps)
            last = max(seen)
            s = (seen[last] - seen[a.skip]) / (last - a.skip)
            per_step[name].append(s)
            if memory:
                params = memory["parameters"]
                state = sum(memory[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes"))
            print(f"{name:<6} run {r}: {s * 1000:8.2f} ms a step (steps {a.skip}..{last})",
                  flush=True)
    plain, spare = statistics.median(per_step["plain"]), statistics.median(per_step["spare"])
    print(f"\nmedian step: plain {plain * 1000:.2f} ms, with buddy copies {spare * 1000:.2f} ms; "
          f"spare / plain {spare / plain:.3f} (+{(spare - plain) * 1000:.2f} ms a step)")
    if params:
        copies = 48 * params / a.nproc
        print(f"host bytes of the copies a rank: {copies / 2**20:.1f} MiB for {params} trainable "
              f"parameters (48 x P / {a.nproc}); rank 0's model state (its memory event: "
              f"parameters, gradients, optimizer): {state / 2**20:.1f} MiB; copies / state "
              f"{copies / state:.2f}")


if __name__ == "__main__":
    main()
