"""DNALLM peer for bench/finetune/bench_dnallm.sh: LoRA fine-tuning of a sequence classifier
with DNALLM's own API (load_model_and_tokenizer, DNADataset, DNATrainer on the Hugging Face
Trainer), on the base model dnallm-train exported (final/hf: `esm` layout, WordLevel k-mer
tokenizer) and the same labelled table as configs/finetune-lora-cpu.toml.

The table's sequences are turned into what the exported tokenizer reads (overlapping k-mers
separated by spaces, DNABERT's convention, docs/hugging-face.md) before DNALLM sees them;
tokenisation (DNADataset.encode_sequences, padded to max_length as DNALLM does) is outside
the timed region, like our loader's start-up is outside our step times.

Variants (--variant):
  dnallm        as DNALLM ships it: load_model_and_tokenizer's attn_implementation="eager",
                TrainingArguments' default optimizer (adamw_torch)
  sdpa-fused    the same model switched to attn_implementation="sdpa" and optim="adamw_torch_fused"
  compile       sdpa-fused with TrainingArguments(torch_compile=True)
Prints one JSON line: train_s (trainer.train(), as HF's train_runtime), steps, samples,
tokens (non-padding tokens of the samples trained on) and tokens/s, final loss.
"""
import argparse
import csv
import json
import os
import tempfile
import time


def kmers(seq, k):
    return " ".join(seq[i:i + k] for i in range(len(seq) - k + 1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="Hugging Face directory (dnallm-train's final/hf)")
    ap.add_argument("--train-csv", required=True, help="sequence,label table")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup-steps", type=int, default=10)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--lora-r", type=int, default=8)
    ap.add_argument("--lora-alpha", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--variant", choices=["dnallm", "sdpa-fused", "compile"], default="dnallm")
    ap.add_argument("--out", default=None, help="scratch output_dir (default: a temp dir)")
    a = ap.parse_args()

    import torch
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    import dnallm
    from dnallm import DNADataset, DNATrainer, load_model_and_tokenizer
    from dnallm.configuration.configs import LoraConfig, TaskConfig, TrainingConfig

    work = a.out or tempfile.mkdtemp(prefix="dnallm-peer-")
    os.makedirs(work, exist_ok=True)
    # The table as the exported tokenizer reads it (k-mers separated by spaces).
    table = os.path.join(work, "train_kmers.csv")
    n_rows = 0
    with open(a.train_csv) as f, open(table, "w", newline="") as g:
        w = csv.writer(g)
        w.writerow(["sequence", "label"])
        for row in csv.DictReader(f):
            w.writerow([kmers(row["sequence"].upper(), a.k), row["label"]])
            n_rows += 1

    task = TaskConfig(task_type="binary", num_labels=2)
    model, tokenizer = load_model_and_tokenizer(a.model, task_config=task, source="local")
    if a.variant != "dnallm":
        model.set_attn_implementation("sdpa")
    attn = model.config._attn_implementation
    ds = DNADataset.load_local_data(table, seq_col="sequence", label_col="label",
                                    tokenizer=tokenizer, max_length=a.max_length)
    ds.encode_sequences()  # DNALLM's default: padding to max_length
    lens = [int(sum(m)) for m in ds.dataset["attention_mask"]]

    finetune = TrainingConfig(
        output_dir=os.path.join(work, "out"), max_steps=a.steps, per_device_train_batch_size=a.batch,
        learning_rate=a.lr, warmup_ratio=0.0, lr_scheduler_type="linear", logging_steps=10,
        eval_strategy="no", save_strategy="no", report_to=["none"], seed=1)
    extra = {"warmup_steps": a.warmup_steps, "dataloader_num_workers": 0, "use_cpu": True,
             "disable_tqdm": True}
    if a.variant != "dnallm":
        extra["optim"] = "adamw_torch_fused"
    if a.variant == "compile":
        extra["torch_compile"] = True
    lora = LoraConfig(r=a.lora_r, lora_alpha=a.lora_alpha, lora_dropout=0.0,
                      target_modules=["query", "key", "value", "dense"])
    trainer = DNATrainer(model=model, config={"task": task, "finetune": finetune, "lora": lora},
                         datasets=ds, extra_args=extra, use_lora=True)
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    t0 = time.perf_counter()
    result = trainer.train()  # DNATrainer.train returns the Trainer's metrics dict
    train_s = time.perf_counter() - t0
    samples = a.steps * a.batch
    # Samples are drawn in a shuffled order; every window has the same length here, so the
    # mean non-padding length times the samples is exact.
    tokens = samples * sum(lens) / len(lens)
    print(json.dumps({
        "peer": "dnallm", "dnallm": dnallm.__version__, "torch": torch.__version__,
        "variant": a.variant, "attn_implementation": attn, "threads": torch.get_num_threads(),
        "model_type": model.config.model_type, "rows": n_rows, "steps": a.steps,
        "batch": a.batch, "padded_length": len(ds.dataset["input_ids"][0]),
        "tokens_per_sample": sum(lens) / len(lens), "trainable_params": trainable,
        "train_s": train_s, "hf_train_runtime": float(result.get("train_runtime", "nan")),
        "samples_per_s": samples / train_s, "tokens_per_s": tokens / train_s,
        "train_loss": float(result.get("train_loss", "nan"))}))


if __name__ == "__main__":
    main()
