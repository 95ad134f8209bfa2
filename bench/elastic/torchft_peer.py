"""The torchft peer of bench/elastic: the model, data and batch of torch_elastic_peer.py (a
small BERT-style masked LM, micro batch 6, 64 tokens) trained with torchft 0.2 (PyPI
`torchft`): per-step quorum from a Lighthouse, torchft.Manager(min_replica_size=1),
torchft.ProcessGroupGloo, torchft.DistributedDataParallel and torchft.Optimizer, with each
replica group one process (group rank 0, group world size 1).

One replica group (what torchft's users run under torchelastic, one per group):
    torchft_peer.py --replica 0 --lighthouse http://host:29510 --metrics r0.jsonl [--ckpt P]
or, for the benchmark, the whole job: an in-process torchft LighthouseServer (min_replicas
1, quorum tick 100 ms, --heartbeat-timeout-ms, --join-timeout-ms) and --replicas groups as
child processes, each started again as soon as it exits (a small supervisor loop standing in
for torchelastic's restart):
    torchft_peer.py --supervise --replicas 2 --metrics m.jsonl [--ckpt P] [--save-steps 5]
The child of group i has RANK=i in its environment (its global rank: group i x group size 1;
the Manager is given group rank 0 explicitly), which is how recovery.py finds the victim.
Group 0 writes --metrics, group i > 0 writes --metrics + ".replica<i>".

JSON lines, each with "t" (wall clock) and "replica": {"event":"start","pid":P} when the
process starts (torch and torchft imported); {"event":"manager","pid":P} when the model,
optimizer and Manager are built (heartbeating to the Lighthouse from then on);
{"event":"restart","kind":"torchft","quorum_id":Q,"participants":N,"step":S} when the
quorum this replica trains in changes, its id or its participants (the groups at the
quorum's max step, as Manager.num_participants() counts them): the first quorum, a group
dropped, a group (re)joined (first with 1 participant while it heals, then with 2), or a
quorum id bumped after a failed commit; written before the step line of the first step in
that quorum; {"event":"restart","kind":"torchft","healed":true,"step":S,"bytes":B} when
this replica loaded a peer's state (B: the bytes of the model and optimizer tensors it
received); {"step":S,"loss":L} after each committed step (S is torchft's committed step
count, the same on all groups); {"event":"discarded","step":S} when a step was not
committed (an allreduce failed, too few replicas); {"event":"checkpoint",
"step":S} after group 0 saved the periodic checkpoint (--ckpt, every --save-steps steps:
torch.save of model, optimizer and Manager state, temporary file then rename, which torchft
still wants for a failure of every group; it is not read on a group restart, a restarted
group heals from a live peer).

What "recovery" means for torchft, as recovery.py measures it. When group 1 is SIGKILLed,
group 0's allreduce in the step in flight fails and that step is discarded (not committed,
so no committed step is lost); its next step waits in the quorum until the Lighthouse stops
counting the dead group: heartbeats every 100 ms, a group is dead after
--heartbeat-timeout-ms without one (torchft's default 5000 ms), and a quorum of 1 out of 2
heartbeating groups is refused ("at least half" rule against split brain), so the quorum
drops the dead group only after the heartbeat timeout. (1) Recovery = from the kill to the
first step committed by the surviving group after its quorum changed (the "restart" event
on group 0's metrics; that quorum may already hold the restarted group if it asked in time).
(2) Rejoin = from the kill to the first step committed by the restarted group 1, after it
was started again, joined a quorum and loaded the healed weights from group 0 over torchft's
HTTP checkpoint transport (the "healed" event on group 1's metrics, then its first step line).
torchft 0.2.0's own DDP comm hook kills the surviving group too when that allreduce fails
(an assertion, see DDP in replica()); this peer's hook lets the Manager discard the step.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))


def replica(a):
    import torch
    import torch.nn as nn
    from torch.distributed import TCPStore
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    sys.path.insert(0, HERE)
    from torch_elastic_peer import TinyMLM

    class DDP(DistributedDataParallel):
        """torchft's DDP wrapper with a comm hook that survives a failed allreduce. torchft
        0.2.0's hook (ddp.py _comm_hook) does `work.wait(); assert work.get_future()._fut`:
        when the allreduce fails (a peer group was SIGKILLed: Gloo "Connection reset by
        peer"), _ManagedWork.wait() reports the error to the Manager and returns False
        without setting _fut, and the assertion kills the surviving group too (and a
        _DummyWork, returned once the Manager has errored, has no _fut at all). Here the
        hook returns the bucket as it is; the Manager has the error, so should_commit()
        discards the step, which is what torchft's error path means to do."""

        @staticmethod
        def _comm_hook(state, bucket):
            work = state.allreduce(bucket.buffer())
            ok = work.wait()
            inner = getattr(work.get_future(), "_fut", None)
            if ok and inner is not None:
                return inner
            done = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done

    gid = a.replica
    torch.set_num_threads(1)
    metrics = open(a.metrics, "a")

    def log(line):
        metrics.write(json.dumps(dict(line, replica=gid, t=time.time())) + "\n")
        metrics.flush()

    log({"event": "start", "pid": os.getpid()})
    vocab, seq = 8, 64
    torch.manual_seed(7)
    model = TinyMLM(vocab, 32, 2, 2, 64, seq)
    inner_opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    healed = {}

    def load_state_dict(state):
        model.load_state_dict(state["model"])
        inner_opt.load_state_dict(state["optim"])
        nbytes = 0
        stack = [state]
        while stack:
            x = stack.pop()
            if isinstance(x, torch.Tensor):
                nbytes += x.numel() * x.element_size()
            elif isinstance(x, dict):
                stack.extend(x.values())
            elif isinstance(x, (list, tuple)):
                stack.extend(x)
        healed["bytes"] = nbytes

    def state_dict():
        return {"model": model.state_dict(), "optim": inner_opt.state_dict()}

    # The replica group's own store (torchelastic would start it: one per group).
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=a.pg_timeout_s))
    manager = Manager(pg=pg, min_replica_size=1, load_state_dict=load_state_dict,
                      state_dict=state_dict, replica_id=f"bench_{gid}", rank=0, world_size=1,
                      store_addr="localhost", store_port=store.port,
                      lighthouse_addr=a.lighthouse, timeout=timedelta(seconds=a.timeout_s),
                      heartbeat_interval=timedelta(milliseconds=100))
    ddp = DDP(manager, model)
    opt = Optimizer(manager, inner_opt)
    log({"event": "manager", "pid": os.getpid()})  # heartbeating to the Lighthouse from here
    last_quorum = None
    while manager.current_step() < a.steps:
        s = manager.current_step()
        g = torch.Generator().manual_seed(s * a.replicas + gid)
        x = torch.randint(0, vocab, (a.micro, seq), generator=g)
        mask = torch.rand(a.micro, seq, generator=g) < 0.15
        inputs = x.masked_fill(mask, vocab - 1)
        opt.zero_grad()  # starts the quorum (async)
        logits = ddp(inputs)
        loss = nn.functional.cross_entropy(logits[mask], x[mask])
        loss.backward()  # allreduce through the Manager
        opt.step()  # should_commit, then the AdamW step only if committed
        step = manager.current_step()
        committed = manager._commit_failures == 0  # reset on a commit (no getter in 0.2.0)
        if "bytes" in healed:
            log({"event": "restart", "kind": "torchft", "healed": True, "step": step,
                 "bytes": healed.pop("bytes")})
        # torchft exposes no getter for the quorum id (0.2.0); the participants are the
        # groups at the quorum's max step (a group that is healing joins them a step later).
        quorum = (manager._quorum_id, manager.num_participants())
        if quorum != last_quorum:
            last_quorum = quorum
            log({"event": "restart", "kind": "torchft", "quorum_id": quorum[0],
                 "participants": quorum[1], "step": step})
        if not committed:
            log({"event": "discarded", "step": step})
            continue
        log({"step": step, "loss": loss.item()})
        if gid == 0 and a.ckpt and step % a.save_steps == 0:
            tmp = a.ckpt + ".tmp"
            torch.save({"model": model.state_dict(), "optim": inner_opt.state_dict(),
                        "torchft": manager.state_dict(), "step": step}, tmp)
            os.replace(tmp, a.ckpt)
            log({"event": "checkpoint", "step": step})
    manager.shutdown(wait=False)


def supervise(a):
    os.environ.setdefault("RUST_LOG", "warn")  # torchft logs every quorum at info
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1,
                                  join_timeout_ms=a.join_timeout_ms, quorum_tick_ms=100,
                                  heartbeat_timeout_ms=a.heartbeat_timeout_ms)
    addr = lighthouse.address()
    print(f"torchft_peer: lighthouse {addr}, heartbeat timeout {a.heartbeat_timeout_ms} ms, "
          f"join timeout {a.join_timeout_ms} ms", file=sys.stderr, flush=True)
    stopping = []

    def stop(signum, frame):
        stopping.append(signum)
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    passthrough = ["--lighthouse", addr, "--replicas", str(a.replicas), "--steps", str(a.steps),
                   "--save-steps", str(a.save_steps), "--micro", str(a.micro),
                   "--timeout-s", str(a.timeout_s), "--pg-timeout-s", str(a.pg_timeout_s)]
    if a.ckpt:
        passthrough += ["--ckpt", a.ckpt]

    def start(i):
        metrics = a.metrics if i == 0 else f"{a.metrics}.replica{i}"
        env = dict(os.environ, RANK=str(i), REPLICA_GROUP_ID=str(i),
                   RUST_LOG=os.environ.get("RUST_LOG", "warn"),
                   NUM_REPLICA_GROUPS=str(a.replicas), OMP_NUM_THREADS="1")
        return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--replica", str(i),
                                 "--metrics", metrics] + passthrough, env=env)

    procs = {i: start(i) for i in range(a.replicas)}
    restarts = 0
    try:
        while True:
            pid, status = os.wait()
            for i, p in list(procs.items()):
                if p.pid != pid:
                    continue
                p.returncode = os.waitstatus_to_exitcode(status)
                print(f"torchft_peer: replica {i} (pid {pid}) exited {p.returncode} at "
                      f"{time.time():.3f}", file=sys.stderr, flush=True)
                if p.returncode == 0 or restarts >= a.max_restarts:
                    return p.returncode
                restarts += 1
                procs[i] = start(i)
    finally:
        for p in procs.values():
            if p.returncode is None:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        lighthouse.shutdown()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--metrics", required=True)
    p.add_argument("--supervise", action="store_true",
                   help="run a Lighthouse and --replicas groups, restarting any that exits")
    p.add_argument("--replica", type=int, default=0, help="this replica group's id")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--lighthouse", default=os.environ.get("TORCHFT_LIGHTHOUSE"))
    p.add_argument("--ckpt", default=None)
    p.add_argument("--steps", type=int, default=1000000)
    p.add_argument("--save-steps", type=int, default=5)
    p.add_argument("--micro", type=int, default=6)
    p.add_argument("--max-restarts", type=int, default=100)
    p.add_argument("--heartbeat-timeout-ms", type=int, default=5000)
    p.add_argument("--join-timeout-ms", type=int, default=60000)
    p.add_argument("--timeout-s", type=float, default=30)
    p.add_argument("--pg-timeout-s", type=float, default=5)
    a = p.parse_args()
    if a.supervise:
        sys.exit(supervise(a) or 0)
    if not a.lighthouse:
        p.error("--lighthouse (or TORCHFT_LIGHTHOUSE) is required without --supervise")
    replica(a)


if __name__ == "__main__":
    main()
