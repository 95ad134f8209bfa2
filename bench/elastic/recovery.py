"""Recovery time of an elastic job after a worker is SIGKILLed: dnallm-launch --standalone
with 2 dnallm-train workers (tiny BERT, Gloo, a checkpoint every --save-steps steps,
resume = "auto"), restarting the group from the checkpoint ("dnallm") and with warm spares
("spare": --spare-workers, one per kill: the survivors stay, a spare takes the dead rank's
place with a peer's state, Note [In-process recovery]) and without spares but with
elastic.shrink ("shrink": the survivor goes on alone in process, and a fresh worker started
in the dead one's stead rejoins once warm, Note [Shrink and grow]; the next kill waits for a
checkpoint after that grow), against torchrun
(torch.distributed.run --standalone) with 2 PyTorch DDP workers over Gloo that resume from a
torch.save checkpoint (torch_elastic_peer.py).

Steps lost per kill: the steps the killed rank had logged that the group runs again (the
kill's step minus the step it resumed at); bytes moved: what the source rank broadcast to
re-form (the restart event's "bytes"; a restart reads the checkpoint instead).

Kill protocol, the same for both, --kills times in one job: wait until a checkpoint was
written in the current generation, then 0..2 steps more; SIGKILL the rank-1 worker (a
child of the launcher whose environment has RANK=1); recovery = from the kill to the
moment the first step line of the restarted group appears in rank 0's metrics file (polled
every millisecond). Both launchers use a 0.1 s monitor interval.

torchft ("torchft", --torchft, on by default when the peer Python imports torchft):
torchft_peer.py --supervise, a torchft Lighthouse and 2 replica groups of 1 process each
(the same model, data and batch, torchft's Manager with min_replica_size=1, its Gloo process
group and DDP/optimizer wrappers; heartbeats every 0.1 s, --torchft-heartbeat-timeout-ms);
the same kill protocol, the victim being replica group 1 (RANK=1), killed once the quorum
holds both groups again, and started again at once by the peer's supervisor loop. Its
"recovery" is from the kill to the first step the surviving group 0 commits after its quorum
dropped the dead group (no restart: group 0 keeps its weights; the step in flight is
discarded, not lost); the "ft-rejoin" row is from the kill to the first step of the restarted
group 1 with the weights it healed from group 0 (its bytes: the model and optimizer state it
received). torchft_peer.py's docstring says more.

    recovery.py --launch build/bin/dnallm-launch [--kills 5] [--zero N] [--no-peer] [--python PY]
                [--ours restart,spare,shrink]
                [--torchft | --no-torchft] [--torchft-only]
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


def pid_of_rank(parent, rank, spare_mode, progress):
    """The worker of `rank`: by its environment, or with spares (a spare that took rank 1's place
    keeps the environment it started with) by the pid line of rank 1's progress file."""
    if not spare_mode:
        return child_with_rank(parent, rank)
    if not progress:
        pid = child_with_rank(parent, rank)
        if pid is None:
            return None
        with open(f"/proc/{pid}/environ", "rb") as f:
            for kv in f.read().split(b"\0"):
                if kv.startswith(b"DNALLM_PROGRESS_FILE="):
                    progress.append(kv.split(b"=", 1)[1].decode())
        return pid
    try:
        with open(progress[0]) as f:
            return int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None


def e_kind(events, i):
    return events[i].get("kind") if i < len(events) else None


def measure(name, cmd, env, metrics, kills, limit_s=300, spare_mode=False, ready=None,
            kill_log=None, wait_after=None):
    """ready(lines): whether the job may be killed now besides the checkpoint rule (torchft:
    both groups in the quorum); kill_log: a list the kill times are appended to;
    wait_after(): run after the last kill, before the job is stopped (torchft: wait for the
    last rejoin)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                            stderr=open(metrics + ".log", "w"), start_new_session=True)
    times, lost, moved = [], [], []
    progress = []  # spare mode: rank 1's progress file
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
                if ckpt and steps and steps[-1] >= ckpt[0] + extra and (ready is None
                                                                         or ready(lines)):
                    victim = pid_of_rank(proc.pid, 1, spare_mode, progress)
                    if victim is None:
                        continue
                    killed_at = time.time()
                    os.kill(victim, signal.SIGKILL)
                    at_step = steps[-1]
                    if kill_log is not None:
                        kill_log.append(killed_at)
                    break
                time.sleep(0.002)
            while True:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"{name}: no step after kill {k + 1} (exit {proc.poll()}); "
                                       f"see {metrics}.log")
                lines = read_lines(metrics)
                events = [l for l in lines if l.get("event") == "restart"]
                if len(events) > restarts_before:
                    # A spare's event follows the first step of the re-formed group (it carries
                    # that step); a restart's precedes the restarted group's first step line.
                    if spare_mode:
                        e = events[restarts_before]
                        if e.get("kind") == "grow":  # an earlier shrink's, written late
                            restarts_before += 1
                            continue
                        first, seen = e["step"], time.time()
                        moved.append(e["bytes"])
                        phases = (f" (agent detection -> step {e['total_s']:.3f} s: abort "
                                  f"{e['abort_s']:.3f}, re-form {e['reform_s']:.3f}, transfer "
                                  f"{e['transfer_s']:.3f}, first step {e['first_step_s']:.3f})")
                        break
                    after = [l for l in since_last_restart(lines) if "event" not in l and "step" in l]
                    if after:
                        first, seen = after[0]["step"], time.time()
                        moved.append(0)
                        break
                time.sleep(0.001)
            regrown = ""
            if e_kind(events, restarts_before) == "shrink":
                # The next kill waits for the grow back (Note [Shrink and grow]).
                while not any(l.get("kind") == "grow" for l in
                              [l for l in read_lines(metrics) if l.get("event") == "restart"]
                              [restarts_before + 1:]):
                    if proc.poll() is not None or time.time() > deadline:
                        raise RuntimeError(f"{name}: no grow after kill {k + 1}; see "
                                           f"{metrics}.log")
                    time.sleep(0.01)
                regrown = f", the group whole again after {time.time() - killed_at:.3f} s"
            times.append(seen - killed_at)
            lost.append(max(0, at_step - (first - 1)))
            print(f"{name:<9} kill {k + 1}: rank 1 at step {at_step}, resumed at step "
                  f"{first - 1}, first step after {times[-1]:.3f} s, steps lost {lost[-1]}, "
                  f"bytes moved {moved[-1]}{phases if spare_mode else ''}{regrown}", flush=True)
        if wait_after is not None:
            wait_after()
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
    return times, lost, moved


def measure_torchft(a, python, version, env, tmp):
    """The torchft rows: "torchft" (kill -> the surviving group's first step after the quorum
    dropped the dead one) and "ft-rejoin" (kill -> the restarted group's first healed step)."""
    metrics = f"{tmp}/torchft.jsonl"
    cmd = [python, os.path.join(HERE, "torchft_peer.py"), "--supervise", "--replicas", "2",
           "--metrics", metrics, "--ckpt", f"{tmp}/torchft.pt", "--save-steps",
           str(a.save_steps), "--max-restarts", str(a.kills + 1),
           "--heartbeat-timeout-ms", str(a.torchft_heartbeat_timeout_ms)]
    print(f"torchft {version} from {python}: Lighthouse heartbeat timeout "
          f"{a.torchft_heartbeat_timeout_ms} ms, Manager heartbeat 0.1 s", flush=True)

    def both_in_quorum(lines):
        events = [l for l in lines if l.get("event") == "restart"]
        return bool(events) and events[-1].get("participants") == 2

    kill_log = []

    def rejoined(limit_s=120):
        deadline = time.time() + limit_s
        while len(torchft_rejoins(metrics, kill_log)) < len(kill_log):
            if time.time() > deadline:
                print(f"torchft: the restarted group did not heal within {limit_s} s of the "
                      f"last kill; see {metrics}.log", flush=True)
                return
            time.sleep(0.01)

    times, lost, _ = measure("torchft", cmd, env, metrics, a.kills, ready=both_in_quorum,
                             kill_log=kill_log, wait_after=rejoined)
    rejoins = torchft_rejoins(metrics, kill_log)
    for k, (t, step, nbytes, started, manager, healed) in enumerate(rejoins):
        print(f"{'ft-rejoin':<9} kill {k + 1}: restarted group 1 imported torch after "
              f"{started:.3f} s, its Manager up after {manager:.3f} s, healed after "
              f"{healed:.3f} s, first healed step {step} after {t:.3f} s, bytes moved {nbytes} "
              f"(group 0's model and optimizer state)", flush=True)
    # The survivor re-forms without moving state (bytes 0); the rejoin moves the state.
    runs = {"torchft": (times, lost, [0] * len(times))}
    if rejoins:
        runs["ft-rejoin"] = ([r[0] for r in rejoins], [0] * len(rejoins),
                             [r[2] for r in rejoins])
    return runs


def peer_python(explicit):
    """The torchft peer's interpreter: --python when given, else what bench/python.sh picks
    ($PYTHON, else $DNALLM_PYTHON, else scripts/python-env.sh's venv), else this one."""
    if explicit:
        return explicit
    venv = os.environ.get("DNALLM_VENV") or os.path.join(
        os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share"),
        "dnallm-dist", "venv")
    for py in (os.environ.get("PYTHON"), os.environ.get("DNALLM_PYTHON"),
               os.path.join(venv, "bin", "python")):
        if py and os.access(py, os.X_OK):
            return py
    return sys.executable


def torchft_version(python):
    """torchft's version in `python`, or None and why not."""
    r = subprocess.run([python, "-c", "import torchft, importlib.metadata as m; "
                        "print(m.version('torchft'))"], capture_output=True, text=True)
    if r.returncode != 0:
        lines = r.stderr.strip().splitlines()
        return None, lines[-1] if lines else f"exit {r.returncode}"
    return r.stdout.strip(), None


def torchft_rejoins(metrics, kill_log):
    """Per kill: seconds from the kill to the first step of the restarted replica group 1
    after it healed, the step, the bytes it received (from its metrics file), and seconds
    from the kill to its start (torch and torchft imported), to its Manager (model built,
    heartbeating) and to its healed event."""
    lines = read_lines(metrics + ".replica1")
    out = []
    for killed_at in kill_log:
        seen = {}
        healed = None
        for l in lines:
            if l.get("t", 0) <= killed_at:
                continue
            if l.get("event") in ("start", "manager"):
                seen.setdefault(l["event"], l["t"] - killed_at)
            if l.get("healed"):
                healed = l
            elif healed is not None and "event" not in l and "step" in l:
                out.append((l["t"] - killed_at, l["step"], healed["bytes"],
                            seen.get("start", float("nan")), seen.get("manager", float("nan")),
                            healed["t"] - killed_at))
                break
        else:
            return out
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--launch", default=os.path.join(SRC, "build/bin/dnallm-launch"))
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--save-steps", type=int, default=5)
    p.add_argument("--python", default=None)
    p.add_argument("--no-peer", action="store_true")
    p.add_argument("--ours", default="restart,spare,shrink",
                   help="which of our rows to run (comma-separated: restart, spare, shrink)")
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3],
                   help="parallel.zero_stage of our runs (the spare's shard then comes from "
                        "its buddy's copy, Note [Buddy copies]); the peers stay DDP")
    p.add_argument("--torchft", action=argparse.BooleanOptionalAction, default=None,
                   help="measure torchft (torchft_peer.py); default: when the peer Python "
                        "imports torchft")
    p.add_argument("--torchft-only", action="store_true",
                   help="measure only torchft (no dnallm-launch, no torchrun)")
    p.add_argument("--torchft-heartbeat-timeout-ms", type=int, default=5000,
                   help="the torchft Lighthouse's heartbeat timeout (torchft's default 5000)")
    a = p.parse_args()
    ft_python = peer_python(a.python)
    a.python = a.python or sys.executable
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
            "checkpoint.resume=auto", "logging.level=warn", f"parallel.zero_stage={a.zero}"]
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
    spare_cmd = [x.replace("/ours", "/spare") for x in ours_cmd]
    spare_cmd[spare_cmd.index("--max-restarts") + 1] = "0"
    spare_cmd += ["--spare-workers", str(a.kills)]
    shrink_cmd = [x.replace("/ours", "/shrink") for x in ours_cmd]
    shrink_cmd[shrink_cmd.index("--max-restarts") + 1] = "0"
    shrink_cmd += ["--set", "elastic.shrink=true"]
    runs = {}
    ours = set(a.ours.split(",")) if not a.torchft_only else set()
    if "restart" in ours:
        runs["dnallm"] = measure("dnallm", ours_cmd, env, f"{tmp}/ours.jsonl", a.kills)
    if "spare" in ours:
        runs["spare"] = measure("spare", spare_cmd, env, f"{tmp}/spare.jsonl", a.kills,
                                spare_mode=True)
    if "shrink" in ours and a.zero == 0:  # Note [Shrink and grow]: DDP only
        runs["shrink"] = measure("shrink", shrink_cmd, env, f"{tmp}/shrink.jsonl", a.kills,
                                 spare_mode=True)
    if not a.no_peer and not a.torchft_only:
        try:
            runs["torchrun"] = measure("torchrun", peer_cmd, env, f"{tmp}/peer.jsonl", a.kills)
        except RuntimeError as e:  # a peer that does not recover is a result, not an error
            print(f"torchrun did not recover: {e}", flush=True)
    if a.torchft is not False or a.torchft_only:
        version, why = torchft_version(ft_python)
        if version is None:
            if a.torchft or a.torchft_only:
                raise RuntimeError(f"torchft: {ft_python} cannot import torchft ({why}); "
                                   f"pip install torchft there")
            print(f"torchft: skipped, {ft_python} cannot import torchft ({why})", flush=True)
        else:
            runs.update(measure_torchft(a, ft_python, version, env, tmp))
    if not runs:
        raise RuntimeError("nothing measured")
    print(f"\n{'launcher':<10}{'median_s':>10}{'min_s':>8}{'max_s':>8}{'lost':>6}{'bytes':>10}")
    med = {}
    for name, (times, lost, moved) in runs.items():
        med[name] = statistics.median(times)
        print(f"{name:<10}{med[name]:>10.3f}{min(times):>8.3f}{max(times):>8.3f}"
              f"{sum(lost):>6}{int(statistics.median(moved)):>10}")
    if "dnallm" in med and "spare" in med:
        m = med["dnallm"]
        print(f"\nrecovery median (kill -> first step of the re-formed group): restart {m:.3f} s, "
              f"spare {med['spare']:.3f} s (goal 0.2 s, 0 steps lost); target {TARGET_S:.0f} s: "
              f"{m / TARGET_S:.2f} of the target")
        print(f"spare / restart: {med['spare'] / m:.2f}")
        if "shrink" in med:
            print(f"shrink (no spare; the survivor goes on alone until a fresh worker rejoins) "
                  f"{med['shrink']:.3f} s; shrink / restart: {med['shrink'] / m:.2f}")
    if "torchrun" in med and "dnallm" in med and "spare" in med:
        print(f"ours / torchrun: {m / med['torchrun']:.2f}, spare / torchrun: "
              f"{med['spare'] / med['torchrun']:.2f} (below 1: we recover faster)")
    if "torchft" in med:
        print(f"\ntorchft (heartbeat timeout {a.torchft_heartbeat_timeout_ms} ms): survivor's "
              f"first step after the quorum dropped the dead group {med['torchft']:.3f} s"
              + (f", restarted group's first healed step {med['ft-rejoin']:.3f} s"
                 if "ft-rejoin" in med else ""))
        if "spare" in med:
            print(f"spare / torchft: {med['spare'] / med['torchft']:.2f}"
                  + (f", spare / ft-rejoin: {med['spare'] / med['ft-rejoin']:.2f}"
                     if "ft-rejoin" in med else "") + " (below 1: we recover faster)")
        if "shrink" in med:
            print(f"shrink / torchft: {med['shrink'] / med['torchft']:.2f} (below 1: we recover "
                  f"faster)")
    subprocess.run(["rm", "-rf", tmp])


if __name__ == "__main__":
    try:
        main()
    except RuntimeError as e:
        print(f"bench/elastic: {e}", file=sys.stderr)
        sys.exit(1)
