"""Chaos run for in-process recovery (Note [In-process recovery]): dnallm-launch --standalone
with 4 dnallm-train ranks and 1 warm spare (tiny BERT, Gloo, a checkpoint every 10 steps),
200 steps; every 20 steps a random rank is SIGKILLed at a random moment of a step (a random
delay after the previous step's line: inside the forward, the backward, the all-reduce, the
optimizer step, or a checkpoint save). The same job runs once without kills first.

It checks that the chaos run finishes in its first generation with every step logged once and
every loss (the final one too) equal to the uninterrupted run's bit for bit, and reports the
time lost per failure: (chaos wall time - reference wall time) / kills, beside each restart
event's phases.

    chaos.py --launch build/bin/dnallm-launch [--steps 200] [--every 20] [--ranks 4]
             [--zero N] [--context-parallel C] [--seed S]
Exit 1 when a run fails or a loss differs.
"""
import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from recovery import child_with_rank, read_lines  # noqa: E402


def progress_files(parent, ranks, deadline):
    """Each rank's DNALLM_PROGRESS_FILE, from the environment of the workers first started: the
    spare that takes a rank's place writes that rank's file (with its own pid)."""
    files = {}
    while len(files) < ranks:
        if time.time() > deadline:
            raise RuntimeError("the workers did not start")
        for r in range(ranks):
            pid = child_with_rank(parent, r)
            if pid is None or r in files:
                continue
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    for kv in f.read().split(b"\0"):
                        if kv.startswith(b"DNALLM_PROGRESS_FILE="):
                            files[r] = kv.split(b"=", 1)[1].decode()
            except OSError:
                pass
        time.sleep(0.01)
    return files


def pid_in(progress_file):
    try:
        with open(progress_file) as f:
            return int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None


def run(cmd, env, metrics, ranks, kill_every, steps, log):
    start = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"),
                            start_new_session=True)
    kills = []
    try:
        files = progress_files(proc.pid, ranks, time.time() + 120) if kill_every else {}
        next_kill = kill_every + random.randint(0, kill_every - 1) if kill_every else None
        step_s = 0.05
        while proc.poll() is None:
            if next_kill is not None and next_kill < steps:
                lines = read_lines(metrics)
                done = [l for l in lines if "event" not in l and "step" in l]
                if done and done[-1]["step"] >= next_kill:
                    if len(done) > 3:
                        step_s = statistics.median(l["step_s"] for l in done[-10:])
                    rank = random.randrange(ranks)
                    time.sleep(random.uniform(0, 1.5 * step_s))  # somewhere in the next step
                    pid = pid_in(files[rank])
                    try:
                        os.kill(pid, signal.SIGKILL)
                        kills.append((done[-1]["step"], rank))
                        print(f"chaos: killed rank {rank} (pid {pid}) after step {done[-1]['step']}",
                              flush=True)
                    except (TypeError, ProcessLookupError):
                        pass  # the rank's file still names a dead process: the next interval
                    next_kill += kill_every
            time.sleep(0.002)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return proc.returncode, time.time() - start, kills


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--launch", default=os.path.join(SRC, "build/bin/dnallm-launch"))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3],
                   help="parallel.zero_stage (Note [Buddy copies])")
    p.add_argument("--context-parallel", type=int, default=1,
                   help="parallel.context_parallel (it must divide --ranks)")
    a = p.parse_args()
    random.seed(a.seed)
    tmp = tempfile.mkdtemp(prefix="dnallm-chaos-")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("DNALLM_JOB_TOKEN", None)

    def cmd(name, spares):
        sets = ["model.hidden=32", "model.layers=2", "model.heads=2", "model.ffn=64",
                "model.max_seq_length=64",
                f'data.train_files=["{SRC}/data/ecoli_k12_mg1655.fa.gz"]',
                f"training.max_steps={a.steps}", "training.micro_batch_size=4",
                "training.lr=3e-3", "training.logging_steps=1", "training.seed=7",
                "data.dataloader_num_workers=1", "parallel.backend=gloo",
                f"checkpoint.dir={tmp}/{name}_ckpt", "checkpoint.save_steps=10",
                "checkpoint.keep_last=2", "logging.level=warn",
                f"parallel.zero_stage={a.zero}", f"parallel.context_parallel={a.context_parallel}"]
        c = [a.launch, "--standalone", "--nproc-per-node", str(a.ranks), "--max-restarts", "0",
             "--monitor-interval", "0.1", "--rdzv-settle", "0.1", "--grace-period", "2",
             "--metrics-file", f"{tmp}/{name}.jsonl"]
        if spares:
            c += ["--spare-workers", str(spares)]
        for s in sets:
            c += ["--set", s]
        return c

    print(f"chaos: {a.ranks} ranks + 1 spare, {a.steps} steps, a kill every {a.every} steps; "
          f"{os.cpu_count()} cores, load {open('/proc/loadavg').read().split()[:3]}", flush=True)
    code, ref_s, _ = run(cmd("ref", 0), env, f"{tmp}/ref.jsonl", a.ranks, 0, a.steps,
                         f"{tmp}/ref.log")
    if code != 0:
        raise RuntimeError(f"the reference run failed ({code}); see {tmp}/ref.log")
    code, chaos_s, kills = run(cmd("chaos", 1), env, f"{tmp}/chaos.jsonl", a.ranks, a.every,
                               a.steps, f"{tmp}/chaos.log")
    if code != 0:
        raise RuntimeError(f"the chaos run failed ({code}) after {len(kills)} kill(s); see "
                           f"{tmp}/chaos.log")
    ref = {l["step"]: l["loss"] for l in read_lines(f"{tmp}/ref.jsonl") if "event" not in l}
    lines = read_lines(f"{tmp}/chaos.jsonl")
    steps = [l["step"] for l in lines if "event" not in l and "step" in l]
    got = {l["step"]: l["loss"] for l in lines if "event" not in l and "step" in l}
    events = [l for l in lines if l.get("event") == "restart"]
    bad = [s for s in range(1, a.steps + 1) if got.get(s) != ref.get(s)]
    repeated = len(steps) - len(set(steps))
    for e in events:
        print(f"  recovery {e['recovery']}: {e['reason']}; step {e['step']} from rank "
              f"{e['source_rank']}, abort {e['abort_s']:.3f} s, re-form {e['reform_s']:.3f} s, "
              f"transfer {e['transfer_s']:.3f} s, first step {e['first_step_s']:.3f} s, total "
              f"{e['total_s']:.3f} s")
    lost = (chaos_s - ref_s) / max(1, len(kills))
    print(f"\nkills {len(kills)}, recoveries {len(events)}, steps logged {len(steps)} "
          f"({repeated} repeated), losses differing from the uninterrupted run: {len(bad)}")
    print(f"final loss: chaos {got.get(a.steps)!r}, uninterrupted {ref.get(a.steps)!r}")
    if events:
        print(f"recovery total (agent detection -> first step), median "
              f"{statistics.median(e['total_s'] for e in events):.3f} s")
    print(f"wall time: uninterrupted {ref_s:.1f} s, chaos {chaos_s:.1f} s; time lost per failure "
          f"{lost:.3f} s (includes starting the replacement spare)")
    ok = not bad and not repeated and len(events) == len(kills)
    if ok:
        subprocess.run(["rm", "-rf", tmp])
    else:
        print(f"chaos: FAILED; files kept in {tmp}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RuntimeError as e:
        print(f"chaos: {e}", file=sys.stderr)
        sys.exit(1)
