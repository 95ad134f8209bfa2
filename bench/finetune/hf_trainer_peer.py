#!/usr/bin/env python3
"""The Hugging Face Trainer side of the fine-tuning parity harness (issue 43;
bench/finetune/parity.sh, tests/hf/finetune_parity_test.sh): fine-tunes a sequence classifier
on a GUE-layout task (train.csv, dev.csv, test.csv: sequence,label) with transformers'
Trainer and the model's reference code, with the hyperparameters of configs/gue-finetune.toml
given on the command line, and scores the best dev checkpoint on test.

The model, by what config.json says:
  * DNABERT-2 (auto_map to bert_layers): its remote code (--dnabert2-ref DIR or
    DNALLM_DNABERT2_REF; tests/hf/dnabert2_reference.py), AutoModelForSequenceClassification;
  * Nucleotide Transformer v2 (auto_map to esm_config): its remote code (--nt-v2-code DIR or
    DNALLM_NT_V2_CODE; tests/hf/hf_common.py import_nt_v2), EsmForSequenceClassification;
  * HyenaDNA (model_type hyenadna): LongSafari's modeling_hyena.py (--hyena-code DIR or
    DNALLM_HYENA_CODE), HyenaDNAForSequenceClassification, its character ids made here
    (A C G T N = 7..11, [SEP] = 1 last, [PAD] = 4 on the left: the hub tokenizer's);
  * anything transformers has itself (bert, esm, ...): AutoModelForSequenceClassification.
A directory that already holds a classifier of --num-labels keeps its head; a base gets a new
one (transformers' initialisation, seeded by --seed).

--order ours gives the Trainer the batches dnallm-train takes: the seeded permutation of
worker/data/sampler.cpp (Note [Sample seeding]), global batch after global batch, the stream
running on over epochs; --order trainer keeps the Trainer's own RandomSampler.

Prints one JSON line: the loss of every step (logging_steps 1), every evaluation (step, loss,
mcc, accuracy), the best step, test scores (mcc, accuracy, macro f1: scikit-learn's
definitions, computed here with numpy) and train_s.
"""
import argparse
import csv
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "hf"))
import dnabert2_reference  # noqa: E402
from hf_common import import_nt_v2, nt_v2_code_dir, reference_package  # noqa: E402

MASK64 = (1 << 64) - 1


def mix64(x):
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def hash_combine(a, b):
    return mix64(a ^ mix64(b))


def permute_index(i, n, seed, epoch):
    """worker/data/sampler.cpp's permute_index: a seeded bijection of [0, n)."""
    if n <= 1:
        return 0
    bits = (n - 1).bit_length()
    half = (bits + 1) // 2
    mask = (1 << half) - 1
    key = hash_combine(hash_combine(seed, epoch), 0x5A3D1E)
    x = i
    while True:
        left, right = x >> half, x & mask
        for r in range(4):
            f = mix64(right ^ hash_combine(key, r)) & mask
            left, right = right, left ^ f
        x = (left << half) | right
        if x < n:
            return x


def our_order(n, seed, samples):
    """The rows dnallm-train reads, in order, for `samples` samples (every rank's together)."""
    return [permute_index(p % n, n, seed, p // n) for p in range(samples)]


def read_table(path):
    with open(path) as f:
        rows = list(csv.DictReader(f))
    return [r["sequence"] for r in rows], [int(r["label"]) for r in rows]


def scores(labels, pred, k):
    """MCC (Gorodkin's R_K, scikit-learn's matthews_corrcoef), accuracy and macro F1."""
    import numpy as np
    c = np.zeros((k, k), dtype=np.float64)
    for t, p in zip(labels, pred):
        c[t, p] += 1
    s, correct = c.sum(), np.trace(c)
    t_sum, p_sum = c.sum(1), c.sum(0)
    den = np.sqrt((s * s - p_sum @ p_sum) * (s * s - t_sum @ t_sum))
    mcc = float((correct * s - t_sum @ p_sum) / den) if den > 0 else 0.0
    f1 = []
    for i in range(k):
        prec = c[i, i] / p_sum[i] if p_sum[i] else 0.0
        rec = c[i, i] / t_sum[i] if t_sum[i] else 0.0
        f1.append(2 * prec * rec / (prec + rec) if prec + rec else 0.0)
    return {"mcc": mcc, "accuracy": float(correct / s), "f1": float(np.mean(f1))}


def load_model(a, transformers, num_labels, scratch):
    """(model, encode, pad id, pads on the left) for the directory: encode(list of sequences)
    -> list of id lists."""
    with open(os.path.join(a.model, "config.json")) as f:
        config = json.load(f)
    auto_map = config.get("auto_map", {})
    overrides = {"num_labels": num_labels, "hidden_dropout_prob": a.dropout,
                 "attention_probs_dropout_prob": a.dropout}
    if dnabert2_reference.is_dnabert2(a.model):
        ref = dnabert2_reference.reference_dir(a.dnabert2_ref)
        if ref is None:
            sys.exit("SKIP: " + dnabert2_reference.SKIP_MESSAGE)
        folder = dnabert2_reference.with_code(ref, a.model, scratch)
        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            folder, trust_remote_code=True, **overrides)
        tok = transformers.AutoTokenizer.from_pretrained(folder)
    elif any("esm_config." in str(v) for v in auto_map.values()):
        code = nt_v2_code_dir(a.nt_v2_code)
        if code is None:
            sys.exit("SKIP: no Nucleotide Transformer v2 code (--nt-v2-code DIR)")
        modeling = import_nt_v2(code)
        model = modeling.EsmForSequenceClassification.from_pretrained(a.model, **overrides)
        tok = transformers.AutoTokenizer.from_pretrained(a.model)
    elif config.get("model_type") == "hyenadna":
        if not a.hyena_code:
            sys.exit("SKIP: no HyenaDNA reference code (--hyena-code DIR)")
        reference_package("hyena_ref", a.hyena_code)
        from hyena_ref.modeling_hyena import HyenaDNAForSequenceClassification
        # (embed_dropout: the hub code's only dropout, 0.1 by default; ours has none, so
        # the comparisons set --dropout 0: docs/models.md)
        model = HyenaDNAForSequenceClassification.from_pretrained(
            a.model, num_labels=num_labels, embed_dropout=a.dropout)
        # Its implicit filters share one Sin frequency per layer (one Parameter under three
        # names); transformers 5's save_pretrained (the Trainer's checkpoints) refuses shared
        # tensors that the model does not declare tied: declare them (no change to training).
        first, tied = {}, {}
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in first:
                tied[name] = first[id(p)]
            else:
                first[id(p)] = name
        model._tied_weights_keys = {**(getattr(model, "_tied_weights_keys", None) or {}), **tied}
        ids = {"A": 7, "C": 8, "G": 9, "T": 10, "N": 11}
        return model, lambda seqs: [[ids.get(b, 6) for b in s.upper()] + [1] for s in seqs], 4, True
    else:
        model = transformers.AutoModelForSequenceClassification.from_pretrained(a.model,
                                                                                **overrides)
        tok = transformers.AutoTokenizer.from_pretrained(a.model)

    def encode(seqs):
        if a.kmer > 0:  # DNABERT-1's input: overlapping k-mers separated by spaces
            seqs = [" ".join(s[i:i + a.kmer] for i in range(len(s) - a.kmer + 1)) for s in seqs]
        return tok(seqs, truncation=True, max_length=a.max_length)["input_ids"]
    return model, encode, tok.pad_token_id, False


def save_init(model, src, dst, k):
    """The classifier as built (its new head included) as a directory of the base's layout: the
    start both systems take for an exact comparison (tests/hf/check_finetune_parity.py)."""
    import shutil
    from safetensors.torch import save_file
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name not in ("config.json", "model.safetensors") and \
                os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    # (clones: HyenaDNA shares one Sin frequency between modules; the file holds each name)
    state = {n: t.detach().clone().contiguous() for n, t in model.state_dict().items()}
    save_file(state, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["architectures"] = [type(model).__name__]
    config["id2label"] = {str(i): f"LABEL_{i}" for i in range(k)}
    config["label2id"] = {f"LABEL_{i}": i for i in range(k)}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def with_lora(a, model):
    if a.lora_r <= 0:
        return model
    import peft
    head = [n for n in ("classifier", "score") if hasattr(model, n)]
    cfg = peft.LoraConfig(r=a.lora_r, lora_alpha=a.lora_alpha, lora_dropout=a.lora_dropout,
                          target_modules=a.lora_targets.split(","), modules_to_save=head,
                          task_type="SEQ_CLS")
    return peft.get_peft_model(model, cfg)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a model directory (ours or the hub's)")
    ap.add_argument("--task", required=True, help="a GUE-layout task directory")
    ap.add_argument("--out", default=None, help="the Trainer's output_dir (default: temporary)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--warmup-steps", type=int, default=50)
    ap.add_argument("--scheduler", default="linear")
    ap.add_argument("--epochs", type=float, default=3)
    ap.add_argument("--max-steps", type=int, default=-1)
    ap.add_argument("--batch", type=int, default=32, help="the global batch")
    ap.add_argument("--eval-steps", type=int, default=200)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--kmer", type=int, default=0,
                    help="give the tokenizer overlapping K-mers separated by spaces (DNABERT-1)")
    ap.add_argument("--best-metric", default="loss", choices=["loss", "mcc", "accuracy"])
    ap.add_argument("--lora-r", type=int, default=0)
    ap.add_argument("--lora-alpha", type=float, default=16)
    ap.add_argument("--lora-dropout", type=float, default=0.05)
    ap.add_argument("--lora-targets", default="query,value")
    ap.add_argument("--order", choices=["ours", "trainer"], default="trainer")
    ap.add_argument("--save-init", default=None,
                    help="only write the classifier as initialised (new head) to this directory")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--dnabert2-ref", default=None)
    ap.add_argument("--nt-v2-code", default=None)
    ap.add_argument("--hyena-code", default=os.environ.get("DNALLM_HYENA_CODE", ""))
    a = ap.parse_args()

    import numpy as np
    import torch
    import transformers
    transformers.logging.set_verbosity_error()
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    transformers.set_seed(a.seed)
    splits = {s: read_table(os.path.join(a.task, s + ".csv")) for s in ("train", "dev", "test")}
    k = max(splits["train"][1]) + 1
    scratch = tempfile.mkdtemp(prefix="hf-trainer-peer-")
    model, encode, pad_id, left_pad = load_model(a, transformers, k, scratch)
    if a.save_init:
        save_init(model, a.model, a.save_init, k)
        print(json.dumps({"saved": a.save_init, "class": type(model).__name__}))
        return
    model = with_lora(a, model)

    class Rows(torch.utils.data.Dataset):
        def __init__(self, seqs, labels):
            self.ids, self.labels = encode(seqs), labels

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.labels[i]}

    def collate(features):
        width = max(len(f["input_ids"]) for f in features)
        ids, mask = [], []
        for f in features:
            pad = [pad_id] * (width - len(f["input_ids"]))
            ids.append(pad + f["input_ids"] if left_pad else f["input_ids"] + pad)
            ones = [1] * len(f["input_ids"])
            mask.append([0] * len(pad) + ones if left_pad else ones + [0] * len(pad))
        batch = {"input_ids": torch.tensor(ids),
                 "labels": torch.tensor([f["labels"] for f in features])}
        if not left_pad:  # HyenaDNA takes no attention mask
            batch["attention_mask"] = torch.tensor(mask)
        return batch

    data = {s: Rows(*splits[s]) for s in splits}
    n_train = len(data["train"])
    steps = a.max_steps if a.max_steps > 0 else int(np.ceil(a.epochs * n_train / a.batch))
    order = our_order(n_train, a.seed, steps * a.batch) if a.order == "ours" else None

    losses = []

    class Trainer(transformers.Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return order if order is not None else super()._get_train_sampler(*args, **kwargs)

        def training_step(self, *args, **kwargs):  # the exact loss (the log rounds it)
            loss = super().training_step(*args, **kwargs)
            losses.append(float(loss))
            return loss

    def compute_metrics(p):
        logits = p.predictions[0] if isinstance(p.predictions, tuple) else p.predictions
        return scores(p.label_ids, logits.argmax(-1), k)

    out = a.out or os.path.join(scratch, "out")
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=a.batch, per_device_eval_batch_size=64,
        learning_rate=a.lr, weight_decay=a.weight_decay, warmup_steps=a.warmup_steps,
        lr_scheduler_type=a.scheduler, num_train_epochs=a.epochs, max_steps=steps,
        max_grad_norm=a.max_grad_norm, eval_strategy="steps", eval_steps=a.eval_steps,
        save_strategy="steps", save_steps=a.eval_steps, save_total_limit=1,
        load_best_model_at_end=True, metric_for_best_model=a.best_metric,
        greater_is_better=a.best_metric != "loss", logging_steps=1, report_to=[], seed=a.seed,
        data_seed=a.seed, use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data["train"],
                      eval_dataset=data["dev"], data_collator=collate,
                      compute_metrics=compute_metrics)
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    evals = [{"step": h["step"], "loss": h["eval_loss"], "mcc": h["eval_mcc"],
              "accuracy": h["eval_accuracy"]}
             for h in trainer.state.log_history if "eval_loss" in h]
    best = trainer.state.best_model_checkpoint
    best_step = int(best.rsplit("-", 1)[1]) if best else None
    test = trainer.predict(data["test"])
    logits = test.predictions[0] if isinstance(test.predictions, tuple) else test.predictions
    print(json.dumps({"system": "hf-trainer", "seed": a.seed, "steps": steps,
                      "losses": losses, "evals": evals, "best_step": best_step,
                      "test": scores(test.label_ids, logits.argmax(-1), k), "train_s": train_s,
                      "torch": torch.__version__, "transformers": transformers.__version__,
                      "lora_r": a.lora_r}))


if __name__ == "__main__":
    main()
