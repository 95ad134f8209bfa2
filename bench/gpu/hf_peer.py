#!/usr/bin/env python3
"""Hugging Face peer for bench/gpu: transformers' BertForMaskedLM in the shape of
configs/dnabert-mlm.toml (hidden 768, 12 layers, 12 heads, FFN 3072, 512 tokens, overlapping
6-mer vocabulary of 4101 = 5 specials + 4^6), SDPA attention, bf16 autocast, fused AdamW,
dropout 0, gradient clipping at 1.0 -- what a Hugging Face Trainer run of DNABERT does, as
a plain loop so that each step can be timed.

Data of the same kind as dnallm-train's: random windows of the bundled E. coli genome (or
their reverse complement, p = 0.5), [CLS] + 510 overlapping 6-mers + [SEP], 15% of the
k-mer tokens selected for the loss, 80% of those replaced by [MASK], 10% by a random k-mer,
10% kept. Batches are built with vectorised torch ops on the host (pinned, copied
non-blocking) while the GPU runs the previous step.

Step times come from CUDA events recorded at every step boundary (no host synchronisation
inside the loop); the loss is read once at the end. Prints one JSON object.

Needs python3 with torch and transformers. Everything but build_model() runs without
transformers: `--self-test` checks the data pipeline and the FLOP accounting on the CPU.
"""
import argparse
import gzip
import json
import math
import os
import statistics
import sys
import time

import torch

PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4
FIRST_KMER = 5
IGNORE = -100

# bf16 dense peak (FLOP/s) by device name; --peak-tflops overrides.
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12,
             "L40S": 362e12, "L4": 121e12, "A10": 125e12}


def peak_flops(name, override_tflops=0.0):
    if override_tflops > 0:
        return override_tflops * 1e12
    for key, value in PEAK_BF16.items():
        if key in name:
            return value
    return float("nan")


def flops_per_token(params, layers, hidden, seq):
    """Model FLOPs per trained token (forward + backward): 6 N + 12 L H S (attention scores
    and values), as in the PaLM appendix and docs/gpu.md."""
    return 6 * params + 12 * layers * hidden * seq


def read_fasta_gz(path):
    parts = []
    with gzip.open(path, "rt") as f:
        for line in f:
            if not line.startswith(">"):
                parts.append(line.strip().upper())
    return "".join(parts)


def encode_bases(seq):
    """A C G T -> 0..3, anything else -> 4 (as a uint8 tensor)."""
    table = torch.full((256,), 4, dtype=torch.uint8)
    for i, b in enumerate(b"ACGT"):
        table[b] = i
    raw = torch.frombuffer(bytearray(seq.encode("ascii")), dtype=torch.uint8)
    return table[raw.long()]


def kmer_ids(codes, k):
    """Token id of the k-mer starting at every position (len - k + 1 of them): 5 + base-4
    index, [UNK] where the k-mer holds a non-ACGT base."""
    n = codes.numel() - k + 1
    idx = torch.zeros(n, dtype=torch.int64)
    bad = torch.zeros(n, dtype=torch.bool)
    for j in range(k):
        c = codes[j:j + n].long()
        bad |= c > 3
        idx = idx * 4 + c.clamp(max=3)
    return torch.where(bad, torch.full_like(idx, UNK), idx + FIRST_KMER)


def reverse_complement_codes(codes):
    rc = codes.flip(0).clone()
    acgt = rc < 4
    rc[acgt] = 3 - rc[acgt]
    return rc


class MlmBatches:
    """Random-window MLM batches over one genome (both strands)."""

    def __init__(self, genome, k=6, seq_len=512, mlm_probability=0.15, seed=42):
        codes = encode_bases(genome)
        self.strands = [kmer_ids(codes, k), kmer_ids(reverse_complement_codes(codes), k)]
        self.k = k
        self.seq_len = seq_len
        self.body = seq_len - 2  # [CLS] ... [SEP]
        self.vocab = FIRST_KMER + 4 ** k
        self.p = mlm_probability
        self.gen = torch.Generator().manual_seed(seed)

    def next(self, rows):
        n = self.strands[0].numel()
        starts = torch.randint(0, n - self.body, (rows,), generator=self.gen)
        strand = torch.rand(rows, generator=self.gen) < 0.5
        offsets = starts[:, None] + torch.arange(self.body)[None, :]
        body = torch.where(strand[:, None], self.strands[1][offsets], self.strands[0][offsets])
        ids = torch.cat([torch.full((rows, 1), CLS), body, torch.full((rows, 1), SEP)], dim=1)
        scorable = ids >= FIRST_KMER
        selected = (torch.rand(ids.shape, generator=self.gen) < self.p) & scorable
        labels = torch.where(selected, ids, torch.full_like(ids, IGNORE))
        r = torch.rand(ids.shape, generator=self.gen)
        random_ids = torch.randint(FIRST_KMER, self.vocab, ids.shape, generator=self.gen)
        inputs = torch.where(selected & (r < 0.8), torch.full_like(ids, MASK), ids)
        inputs = torch.where(selected & (r >= 0.8) & (r < 0.9), random_ids, inputs)
        return inputs, labels


def build_model(args, vocab):
    import transformers  # only here: the rest runs without it
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=vocab, hidden_size=args.hidden,
                        num_hidden_layers=args.layers, num_attention_heads=args.heads,
                        intermediate_size=args.ffn, max_position_embeddings=args.seq,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        pad_token_id=PAD)
    auto = getattr(transformers, "AutoModelForMaskedLM", None)
    try:  # the public spelling (transformers 4.36+)
        model = auto.from_config(config, attn_implementation=args.attn)
    except (AttributeError, TypeError, ValueError):
        try:
            model = BertForMaskedLM._from_config(config, attn_implementation=args.attn)
        except (AttributeError, TypeError):  # older: set it on the config
            config._attn_implementation = args.attn
            model = BertForMaskedLM(config)
    # What transformers really uses (it may fall back, e.g. to eager): reported in the JSON.
    effective = getattr(model.config, "_attn_implementation", args.attn)
    if effective != args.attn:
        print(f"hf_peer: asked for attention '{args.attn}', transformers uses '{effective}'",
              file=sys.stderr)
    return model


def train(args):
    import transformers

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    cuda = device.type == "cuda"
    batches = MlmBatches(read_fasta_gz(args.fasta), k=args.k, seq_len=args.seq,
                         mlm_probability=args.mlm_probability, seed=args.seed)
    model = build_model(args, batches.vocab).to(device)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt_kwargs = dict(lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    if cuda:
        opt_kwargs["fused"] = True
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": no_decay, "weight_decay": 0.0}], **opt_kwargs)
    total = args.warmup + args.steps
    warm = max(1, int(0.1 * total))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, max(0.0, (total - s) / max(1, total - warm))))
    bf16 = args.precision == "bf16"

    def to_device(t):
        return t.pin_memory().to(device, non_blocking=True) if cuda else t

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(total + 1)]
        events[0].record()
    wall = [time.perf_counter()]
    losses = []
    inputs, labels = (to_device(t) for t in batches.next(args.micro_batch))
    for step in range(total):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            out = model(input_ids=inputs, labels=labels)
        out.loss.backward()
        # The next batch is built on the host while the GPU runs this step.
        next_inputs, next_labels = (to_device(t) for t in batches.next(args.micro_batch))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.detach())
        inputs, labels = next_inputs, next_labels
        if cuda:
            events[step + 1].record()
        wall.append(time.perf_counter())
    if cuda:
        torch.cuda.synchronize(device)
        step_s = [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(total)]
    else:
        step_s = [wall[i + 1] - wall[i] for i in range(total)]
    timed = step_s[args.warmup:]
    median = statistics.median(timed)
    tokens_per_s = args.micro_batch * args.seq / median
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    fpt = flops_per_token(params, args.layers, args.hidden, args.seq)
    loss_values = [float(x) for x in torch.stack(losses).float().cpu()]
    result = {
        "impl": "hf-bert-" + str(getattr(model.config, "_attn_implementation", args.attn)),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": name,
        "micro_batch": args.micro_batch,
        "seq": args.seq,
        "parameters": params,
        "warmup": args.warmup,
        "steps": args.steps,
        "median_step_s": median,
        "p90_step_s": sorted(timed)[int(0.9 * (len(timed) - 1))],
        "tokens_per_s": tokens_per_s,
        "flops_per_token": fpt,
        "mfu": tokens_per_s * fpt / peak_flops(name, args.peak_tflops),
        "peak_allocated_mb": torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None,
        "peak_reserved_mb": torch.cuda.max_memory_reserved(device) / 2**20 if cuda else None,
        "loss_first": loss_values[0],
        "loss_last": loss_values[-1],
        "losses": loss_values,
    }
    print(json.dumps(result))


def self_test(args):
    """The parts without transformers, on the CPU, on a small synthetic genome."""
    genome = ("ACGTTGCAAC" * 300) + "NNNN" + ("GGCATTACGA" * 300)
    b = MlmBatches(genome, k=6, seq_len=64, mlm_probability=0.15, seed=1)
    assert b.vocab == 4101, b.vocab
    # k-mer ids: AAAAAA -> 5, TTTTTT -> 5 + 4095, N -> UNK, reverse complement of ACGTTG = CAACGT.
    assert kmer_ids(encode_bases("AAAAAAT"), 6).tolist() == [5, 5 + 3]
    assert kmer_ids(encode_bases("TTTTTT"), 6).tolist() == [5 + 4095]
    assert kmer_ids(encode_bases("ACGTNAC"), 6).tolist() == [UNK, UNK]
    rc = reverse_complement_codes(encode_bases("ACGTTG"))
    assert kmer_ids(rc, 6).tolist() == kmer_ids(encode_bases("CAACGT"), 6).tolist()
    selected = total = 0
    for _ in range(50):
        inputs, labels = b.next(8)
        assert inputs.shape == (8, 64) and labels.shape == (8, 64)
        assert (inputs[:, 0] == CLS).all() and (inputs[:, -1] == SEP).all()
        assert ((labels == IGNORE) | (labels >= FIRST_KMER)).all()
        assert (inputs < 4101).all() and (inputs >= 0).all()
        picked = labels != IGNORE
        # Unpicked tokens are untouched; picked ones are mostly [MASK].
        kept = inputs[~picked]
        assert (kept != MASK).all()
        selected += int(picked.sum())
        total += int((inputs[:, 1:-1] != UNK).sum())
    frac = selected / total
    assert 0.12 < frac < 0.18, frac
    # FLOPs: the dnabert-mlm shape (89 M parameters) at micro-batch 64 and 381k tokens/s is
    # about 23% of an H100 (docs/gpu.md).
    fpt = flops_per_token(89_000_000, 12, 768, 512)
    mfu = 381e3 * fpt / peak_flops("NVIDIA H100 80GB HBM3")
    assert 0.2 < mfu < 0.26, mfu
    assert math.isnan(peak_flops("Some GPU"))
    have_tf = True
    try:
        import transformers  # noqa: F401
    except ImportError:
        have_tf = False
        sys.modules["transformers"] = _StubTransformers()
    # The training loop itself, on the CPU with a tiny shape (a stand-in model where
    # transformers is missing): it must run and print its JSON line.
    tiny = argparse.Namespace(**vars(args))
    for key, value in dict(cpu=True, micro_batch=2, warmup=1, steps=3, seq=32, hidden=16,
                           layers=1, heads=2, ffn=32, precision="fp32").items():
        setattr(tiny, key, value)
    train(tiny)
    print(json.dumps({"self_test": "ok", "mask_fraction": round(frac, 4),
                      "mfu_check": round(mfu, 4), "transformers": have_tf}))


class _StubTransformers:
    """Stands in for transformers in --self-test only: a tiny masked LM with BERT's call."""
    __version__ = "stub"

    class BertConfig:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    class BertForMaskedLM(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config = config
            self.emb = torch.nn.Embedding(config.vocab_size, config.hidden_size)
            self.out = torch.nn.Linear(config.hidden_size, config.vocab_size)

        @classmethod
        def _from_config(cls, config, attn_implementation=None):
            return cls(config)

        def forward(self, input_ids, labels):
            logits = self.out(self.emb(input_ids))
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                     labels.flatten(), ignore_index=IGNORE)
            return argparse.Namespace(loss=loss, logits=logits)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--fasta", default=os.path.join(root, "data", "ecoli_k12_mg1655.fa.gz"))
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--ffn", type=int, default=3072)
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--mlm-probability", type=float, default=0.15)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--peak-tflops", type=float, default=0.0,
                    help="device peak for MFU (default: known bf16 peaks by device name)")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (tiny shapes only)")
    ap.add_argument("--self-test", action="store_true",
                    help="check the data pipeline and FLOP accounting without transformers")
    args = ap.parse_args()
    if args.self_test:
        self_test(args)
    else:
        train(args)


if __name__ == "__main__":
    sys.exit(main())
