#!/usr/bin/env python3
"""Issue 43, the small version of bench/finetune/parity.sh that CI runs: a whole fine-tune by
dnallm-train (2 ranks under dnallm-launch, configs/gue-finetune.toml's protocol: AdamW with
weight decay, linear warm-up and decay, gradient clipping, evaluation on dev, the best
checkpoint kept and scored on test by dnallm-eval) and by the Hugging Face Trainer
(bench/finetune/hf_trainer_peer.py, transformers' BertForSequenceClassification), from the
same classifier directory (the bert_cls fixture: DNABERT-1-shaped, overlapping 3-mers), with
dropout off and the same batch order (the peer replays our sampler's permutation):

  * every one of the 20 steps' training loss within 1e-4;
  * the same evaluations (steps 10 and 20): dev loss within 1e-4, the same accuracy and MCC;
  * the same best step, and the same test accuracy and MCC.

The task is species60 of scripts/make-gue-tasks.py (60-base windows of E. coli or S. aureus),
which a tiny model learns within 20 steps, so the scores compared are not those of a constant
prediction (the check fails when the final dev MCC is 0).

  check_finetune_parity.py --train build/bin/dnallm-train --source-dir . [--keep DIR]
      [--model DIR --set key=value ... --kmer K --max-length N]   (another base; e.g. the
      DNABERT-2 and NT-v2 bases of bench/finetune/parity.sh, whose reference code the peer
      finds in DNALLM_DNABERT2_REF / DNALLM_NT_V2_CODE)
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

LOSS_TOLERANCE = 1e-4
STEPS, EVAL_STEPS, GLOBAL_BATCH, RANKS = 20, 10, 16, 2
HYPER = {"lr": 2e-2, "warmup_steps": 5, "weight_decay": 0.01, "max_grad_norm": 0.5, "seed": 3}


def run(cmd, what):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        sys.exit(f"FAIL: {what} exited {p.returncode}:\n{p.stderr[-3000:]}")
    return p.stdout


def ours(args, model, task, work):
    bin_dir = os.path.dirname(os.path.abspath(args.train))
    ck = os.path.join(work, "ours")
    metrics = os.path.join(work, "ours.jsonl")
    sets = {
        "model.init_from": model, "model.num_labels": 2,
        "model.max_seq_length": args.max_length, "model.dropout": 0,
        "data.train_files": f'["{task}/train.csv"]', "data.eval_files": f'["{task}/dev.csv"]',
        "training.seed": HYPER["seed"], "training.micro_batch_size": GLOBAL_BATCH // RANKS,
        "training.max_steps": STEPS, "training.num_train_epochs": 0,
        "training.eval_steps": EVAL_STEPS, "training.logging_steps": 1,
        "training.lr": HYPER["lr"], "training.warmup_steps": HYPER["warmup_steps"],
        "training.weight_decay": HYPER["weight_decay"],
        "training.max_grad_norm": HYPER["max_grad_norm"], "training.lr_scheduler": "linear",
        "checkpoint.dir": ck, "logging.metrics_file": metrics, "logging.tensorboard_dir": "",
    }
    cmd = [os.path.join(bin_dir, "dnallm-launch"), "--nproc-per-node", str(RANKS), "--",
           args.train, "--config", os.path.join(args.source_dir, "configs", "gue-finetune.toml"),
           "--log-level", "warn"]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    for kv in args.set:
        cmd += ["--set", kv]
    run(cmd, "dnallm-train")
    lines = [json.loads(line) for line in open(metrics)]
    losses = [line["loss"] for line in lines if "event" not in line and "loss" in line]
    evals = [line for line in lines if line.get("event") == "eval"]
    best = json.load(open(os.path.join(ck, "best", "best.json")))
    test = json.loads(run([os.path.join(bin_dir, "dnallm-eval"), "--model",
                           os.path.join(ck, "best"), "--table", f"{task}/test.csv"],
                          "dnallm-eval").strip().splitlines()[-1])
    return {"losses": losses, "evals": evals, "best_step": best["step"], "test": test}


def peer(args, model, task):
    script = os.path.join(args.source_dir, "bench", "finetune", "hf_trainer_peer.py")
    out = run([sys.executable, script, "--model", model, "--task", task, "--order", "ours",
               "--seed", str(HYPER["seed"]), "--lr", str(HYPER["lr"]),
               "--warmup-steps", str(HYPER["warmup_steps"]),
               "--weight-decay", str(HYPER["weight_decay"]),
               "--max-grad-norm", str(HYPER["max_grad_norm"]), "--max-steps", str(STEPS),
               "--batch", str(GLOBAL_BATCH), "--eval-steps", str(EVAL_STEPS), "--dropout", "0",
               "--kmer", str(args.kmer), "--max-length", str(args.max_length), "--threads", "1"],
              "hf_trainer_peer.py")
    return json.loads(out.strip().splitlines()[-1])


def compare(a, b):
    problems = []
    if len(a["losses"]) != STEPS or len(b["losses"]) != STEPS:
        problems.append(f"steps logged: ours {len(a['losses'])}, Trainer {len(b['losses'])} "
                        f"(want {STEPS})")
    worst = max((abs(x - y), i + 1) for i, (x, y) in enumerate(zip(a["losses"], b["losses"])))
    print(f"training loss, {STEPS} steps: max |ours - Trainer| = {worst[0]:.2e} (step {worst[1]})")
    if worst[0] > LOSS_TOLERANCE:
        problems.append(f"step {worst[1]}: training loss differs by {worst[0]:.2e} > "
                        f"{LOSS_TOLERANCE}")
    if [e["step"] for e in a["evals"]] != [e["step"] for e in b["evals"]]:
        problems.append(f"evaluated at steps {[e['step'] for e in a['evals']]} (ours) and "
                        f"{[e['step'] for e in b['evals']]} (Trainer)")
    for x, y in zip(a["evals"], b["evals"]):
        print(f"dev at step {x['step']}: loss {x['loss']:.6f} / {y['loss']:.6f}, accuracy "
              f"{x['accuracy']:.4f} / {y['accuracy']:.4f}, MCC {x['mcc']:.4f} / {y['mcc']:.4f} "
              "(ours / Trainer)")
        if abs(x["loss"] - y["loss"]) > LOSS_TOLERANCE:
            problems.append(f"dev loss at step {x['step']}: {x['loss']} vs {y['loss']}")
        for key in ("accuracy", "mcc"):
            if abs(x[key] - y[key]) > 1e-9:
                problems.append(f"dev {key} at step {x['step']}: {x[key]} vs {y[key]}")
    if a["evals"] and a["evals"][-1]["mcc"] == 0:
        problems.append("the final dev MCC is 0: the model predicts one class, and the scores "
                        "compared say nothing (a task or learning rate the model cannot learn)")
    if a["best_step"] != b["best_step"]:
        problems.append(f"best step {a['best_step']} (ours) vs {b['best_step']} (Trainer)")
    for key in ("accuracy", "mcc"):
        print(f"test {key}: ours {a['test'][key]:.6f}, Trainer {b['test'][key]:.6f}")
        if abs(a["test"][key] - b["test"][key]) > 1e-9:
            problems.append(f"test {key}: {a['test'][key]} vs {b['test'][key]}")
    return problems


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train", required=True, help="the dnallm-train binary")
    ap.add_argument("--source-dir", required=True)
    ap.add_argument("--keep", default=None, help="keep the runs in this folder")
    ap.add_argument("--model", default=None, help="default: the bert_cls fixture")
    ap.add_argument("--set", action="append", default=None,
                    help="dnallm-train settings for --model (its tokenizer)")
    ap.add_argument("--kmer", type=int, default=None)
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--lr", type=float, default=HYPER["lr"])
    args = ap.parse_args()
    if args.model is None:  # DNABERT-1-shaped: overlapping 3-mers, 64 positions
        args.set = args.set or ["tokenizer.kind=kmer", "tokenizer.k=3", "tokenizer.stride=1"]
        args.kmer = 3 if args.kmer is None else args.kmer
    args.set = args.set or []
    HYPER["lr"] = args.lr
    args.kmer = args.kmer or 0
    work = args.keep or tempfile.mkdtemp(prefix="finetune-parity-")
    os.makedirs(work, exist_ok=True)
    try:
        model = args.model or os.path.join(args.source_dir, "tests", "data", "hf-fixtures",
                                           "bert_cls")
        run([sys.executable, os.path.join(args.source_dir, "scripts", "make-gue-tasks.py"),
             "--out", work, "--tasks", "species60", "--train", "320", "--dev", "64", "--test",
             "64"], "make-gue-tasks.py")
        task = os.path.join(work, "species60")
        if args.model:  # a base: both start from the classifier the Trainer's code initialises
            start = os.path.join(work, "start")
            run([sys.executable, os.path.join(args.source_dir, "bench", "finetune",
                                              "hf_trainer_peer.py"), "--model", model, "--task",
                 task, "--seed", str(HYPER["seed"]), "--save-init", start], "the classifier's start")
            model = start
        problems = compare(ours(args, model, task, work), peer(args, model, task))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if problems:
        print("FAIL: dnallm-train and the Hugging Face Trainer differ:\n  " + "\n  ".join(problems))
        return 1
    print("OK: dnallm-train's fine-tune equals the Hugging Face Trainer's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
