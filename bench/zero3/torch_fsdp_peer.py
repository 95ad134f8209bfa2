"""PyTorch FSDP2 over Gloo on the CPU, bench-cpu model: the peer for bench/zero3/bench_zero3.sh.

Same model, initialisation and batch drawing as bench/train/torch_peer.py (each rank draws its
own micro-batch of `--batch` sequences, as bench/ddp/torch_ddp_peer.py). Sharding as torchtitan
applies it: `torch.distributed.fsdp.fully_shard` on each transformer block, then on the root
(embeddings, final LayerNorm, MLM head), over a 1-D CPU device mesh of `--world` ranks;
defaults otherwise (blocks reshard after forward, the root does not; implicit prefetch).
The optimizer is built after sharding, so AdamW's moments are sharded DTensors too.

--mode fsdp2 runs fully_shard and fails if it fails; --mode ddp runs
DistributedDataParallel; --mode auto (default) tries fsdp2 and, if any rank raises, prints
the error on stderr and runs DDP instead, naming the error in the output ("fsdp2_error").

Memory, per rank, measured at the end of the last timed step (after optimizer.step(), the
gradients still held):
  model_state_bytes: parameters (the local shard of each DTensor), gradients and optimizer
    state as this rank allocated them: the bytes of every distinct storage behind those
    tensors (a padded shard counts its padding; a view shares its base's storage once);
  peak_rss_kb: VmHWM of /proc/self/status, the process's peak resident set (spawned
    workers are fresh interpreters, so the parent's memory is not in it);
  import_rss_kb: VmRSS once torch is imported and the process group is up, before the model
    (with the PyPI CUDA wheels most of the peak: the libraries torch maps at import).
Prints one JSON object (all ranks' memory, rank 0's step times).
"""
import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "train"))
from torch_peer import BertMLM, add_step_arguments, make_optimizer, read_genome, timed_steps  # noqa: E402

VARIANTS = {"eager": ("eager", False), "sdpa-fused": ("sdpa", True)}  # attention, fused AdamW


def local(t):
    """The tensor this rank holds: a DTensor's local shard, else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def storage_bytes(tensors):
    """Bytes of the distinct storages behind `tensors` (each counted once)."""
    seen = {}
    for t in tensors:
        if t is None:
            continue
        s = local(t).untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def model_state(model, opt):
    params = list(model.parameters())
    state = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    p, g, o = storage_bytes(params), storage_bytes(p.grad for p in params), storage_bytes(state)
    return {"params_bytes": p, "grads_bytes": g, "optimizer_bytes": o,
            "model_state_bytes": p + g + o,
            "local_params": sum(local(q).numel() for q in params)}


def status_kb(key):
    """A /proc/self/status figure in kB: VmHWM (peak resident set) or VmRSS (now)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return -1


def shard(model, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world,))
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def worker(rank, args, mode, out):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    import_rss_kb = status_kb("VmRSS")  # the interpreter, torch and gloo, before any model
    torch.manual_seed(1)  # the same initial model on every rank, as the DDP peer
    genome = read_genome(args.fasta)
    rng = torch.Generator().manual_seed(1 + rank)
    attn, fused = VARIANTS[args.variant]
    model = BertMLM(seq=args.seq, attn=attn)
    if mode == "fsdp2":
        model = shard(model, args.world)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = make_optimizer(model, fused)
    times, final_loss = timed_steps(model, opt, genome, rng, args.warmup, args.steps, args.batch,
                                    args.seq)
    out.put({"rank": rank, "step_s": times, "final_loss": final_loss,
             "peak_rss_kb": status_kb("VmHWM"), "import_rss_kb": import_rss_kb,
             **model_state(model, opt)})
    dist.destroy_process_group()


def run(args, mode):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    mp.spawn(worker, args=(args, mode, out), nprocs=args.world)
    return sorted((out.get() for _ in range(args.world)), key=lambda r: r["rank"])


def main():
    ap = argparse.ArgumentParser()
    add_step_arguments(ap, warmup=2, steps=4, threads=1, variant="sdpa-fused", variants=VARIANTS)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--port", type=int, default=29651)
    ap.add_argument("--mode", choices=["auto", "fsdp2", "ddp"], default="auto")
    args = ap.parse_args()
    mode, error = ("fsdp2" if args.mode == "auto" else args.mode), None
    try:
        ranks = run(args, mode)
    except Exception as e:  # a rank raised (mp.ProcessRaisedException) or died
        if args.mode != "auto":
            raise
        lines = [l for l in str(e).strip().splitlines() if l.strip()]
        error = lines[-1] if lines else repr(e)
        print(f"torch_fsdp_peer: fully_shard failed, falling back to DDP: {error}", file=sys.stderr)
        print(str(e), file=sys.stderr)
        mode, args.port = "ddp", args.port + 1
        ranks = run(args, mode)
    times = ranks[0]["step_s"]
    med = statistics.median(times)
    print(json.dumps({"peer": f"pytorch-{mode}-gloo", "mode": mode, "fsdp2_error": error,
                      "variant": args.variant, "torch": torch.__version__, "world": args.world,
                      "threads_per_rank": args.threads, "step_s": times, "step_s_median": med,
                      "tokens_per_s": args.world * args.batch * args.seq / med,
                      "final_loss": ranks[0]["final_loss"],
                      "ranks": [{k: v for k, v in r.items() if k not in ("step_s", "final_loss")}
                                for r in ranks]}))


if __name__ == "__main__":
    main()
