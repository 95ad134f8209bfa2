"""Recovery time of an elastic job after a worker is SIGKILLed: dnallm-launch --standalone
with 2 dnallm-train workers (tiny BERT, Gloo, a checkpoint every --save-steps steps,
resume = "auto") against torchrun (torch.distributed.run --standalone) with 2 PyTorch DDP
workers over Gloo that resume from a torch.save checkpoint (torch_elastic_peer.py).

Kill protocol, the same for both, --kills times in one job: wait until a checkpoint was
written in the current generation, then 0..2 steps more; SIGKILL the rank-1 worker (a
child of the launcher whose environment has RANK=1); recovery = from the kill to the
moment the first step line of the restarted group appears in rank 0's metrics file (polled
every millisecond). Both launchers use a 0.1 s monitor interval.

    recovery.py --launch build/bin/dnallm-launch [--kills 5] [--no-peer] [--python PY]
Prints one line per kill and a summary; exit 1 when a run fails.
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

TARGET_S = 5.0
# python -m torch.distributed.run (torchrun), as `python -c` so that --python picks the torch.
TORCHRUN = """
from torch.distributed.run import main
main()
"""
HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.dirname(os.path.dirname(HERE))


def read_lines(path):
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return []
    out = []
    for line in text.split("\n")[:-1]:  # complete lines only
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def since_last_restart(lines):
    start = 0
    for i, l in enumerate(lines):
        if l.get("event") == "restart":
            start = i + 1
    return lines[start:]


def child_with_rank(parent, rank):
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            if ppid != parent:
                continue
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
            if f"RANK={rank}".encode() in env:
                return int(name)
        except (OSError, ValueError):
            continue
    return None


def measure(name, cmd, env, metrics, kills, limit_s=300):
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                            stderr=open(metrics + ".log", "w"), start_new_session=True)
    times = []
    try:
        for k in range(kills):
            extra = random.randint(0, 2)
            deadline = time.time() + limit_s
            victim = None
            restarts_before = 0
            while victim is None:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"{name}: no checkpoint before kill {k + 1} "
                                       f"(exit {proc.poll()}); see {metrics}.log")
                lines = read_lines(metrics)
                restarts_before = sum(1 for l in lines if l.get("event") == "restart")
                cur = since_last_restart(lines)
                ckpt = [l["step"] for l in cur if l.get("event") == "checkpoint"]
                steps = [l["step"] for l in cur if "event" not in l and "step" in l]
                if ckpt and steps and steps[-1] >= ckpt[0] + extra:
                    victim = child_with_rank(proc.pid, 1)
                    if victim is None:
                        continue
                    killed_at = time.time()
                    os.kill(victim, signal.SIGKILL)
                    at_step = steps[-1]
                    break
                time.sleep(0.002)
            while True:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"{name}: no step after kill {k + 1} (exit {proc.poll()}); "
                                       f"see {metrics}.log")
                lines = read_lines(metrics)
                if sum(1 for l in lines if l.get("event") == "restart") > restarts_before:
                    after = since_last_restart(lines)
                    first = [l for l in after if "event" not in l and "step" in l]
                    if first:
                        seen = time.time()
                        break
                time.sleep(0.001)
            times.append(seen - killed_at)
            print(f"{name:<9} kill {k + 1}: rank 1 at step {at_step}, resumed at step "
                  f"{first[0]['step'] - 1}, first step after {times[-1]:.3f} s", flush=True)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return times


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--launch", default=os.path.join(SRC, "build/bin/dnallm-launch"))
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--save-steps", type=int, default=5)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--no-peer", action="store_true")
    a = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="dnallm-bench-elastic-")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("DNALLM_JOB_TOKEN", None)
    interval = "0.1"

    sets = ["model.hidden=32", "model.layers=2", "model.heads=2", "model.ffn=64",
            "model.max_seq_length=64",
            f'data.train_files=["{SRC}/data/ecoli_k12_mg1655.fa.gz"]',
            "training.max_steps=1000000", "training.micro_batch_size=6",
            "training.logging_steps=1", "training.seed=7", "data.dataloader_num_workers=1",
            "parallel.backend=gloo", f"checkpoint.dir={tmp}/ours_ckpt",
            f"checkpoint.save_steps={a.save_steps}", "checkpoint.keep_last=2",
            "checkpoint.resume=auto", "logging.level=warn"]
    ours_cmd = [a.launch, "--standalone", "--nproc-per-node", "2", "--max-restarts",
                str(a.kills + 1), "--monitor-interval", interval, "--rdzv-settle", "0.1",
                "--grace-period", "1", "--metrics-file", f"{tmp}/ours.jsonl"]
    for s in sets:
        ours_cmd += ["--set", s]
    peer_cmd = [a.python, "-c", TORCHRUN, "--standalone", "--nproc_per_node", "2",
                "--max_restarts", str(a.kills + 1), "--monitor_interval", interval,
                os.path.join(HERE, "torch_elastic_peer.py"), "--ckpt", f"{tmp}/peer.pt",
                "--metrics", f"{tmp}/peer.jsonl", "--save-steps", str(a.save_steps)]

    print(f"bench/elastic: {a.kills} kills per launcher, 2 workers, monitor interval {interval} s, "
          f"{os.cpu_count()} cores, load {open('/proc/loadavg').read().split()[:3]}", flush=True)
    ours = measure("dnallm", ours_cmd, env, f"{tmp}/ours.jsonl", a.kills)
    peer = None if a.no_peer else measure("torchrun", peer_cmd, env, f"{tmp}/peer.jsonl", a.kills)
    m = statistics.median(ours)
    print(f"\n{'launcher':<10}{'median_s':>10}{'min_s':>8}{'max_s':>8}")
    print(f"{'dnallm':<10}{m:>10.3f}{min(ours):>8.3f}{max(ours):>8.3f}")
    if peer:
        pm = statistics.median(peer)
        print(f"{'torchrun':<10}{pm:>10.3f}{min(peer):>8.3f}{max(peer):>8.3f}")
    print(f"\nrecovery median (kill -> first step of the restarted group): {m:.3f} s; "
          f"target {TARGET_S:.0f} s: {m / TARGET_S:.2f} of the target")
    if peer:
        print(f"ours / torchrun: {m / pm:.2f} (below 1: we recover faster)")
    subprocess.run(["rm", "-rf", tmp])


if __name__ == "__main__":
    try:
        main()
    except RuntimeError as e:
        print(f"bench/elastic: {e}", file=sys.stderr)
        sys.exit(1)
