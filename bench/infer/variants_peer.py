#!/usr/bin/env python3
"""The Python peer of bench/infer/bench_variants.sh, and the reference of tests/hf/check_variants.py:
zero-shot variant scores of a Hugging Face directory computed with transformers as Note
[Zero-shot variant effects] (worker/infer/variants.hpp) defines them, by the loop a user
writes: each SNV's windows tokenized and run (causal: the reference and the alternative window
in one batch of 2; masked: the masked reference window), under torch.no_grad().

  python bench/infer/variants_peer.py --model DIR --reference REF.fa --vcf V.vcf --window W
      [--rc-average] [--threads N] --out scores.tsv
prints one JSON line: variants, seconds (the loop alone; loading excluded), variants_per_s.
"""
import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

COMP = {"A": "T", "C": "G", "G": "C", "T": "A", "N": "N"}


def revcomp(s):
    return "".join(COMP[c] for c in reversed(s))


def centred(pos, window, length):
    window = min(window, length)
    begin = max(0, pos - window // 2)
    end = min(length, begin + window)
    return max(0, end - window), end


class Reference:
    """The scores as Note [Zero-shot variant effects] defines them, with transformers."""

    def __init__(self, folder, causal):
        self.tok = AutoTokenizer.from_pretrained(folder)
        cls = AutoModelForCausalLM if causal else AutoModelForMaskedLM
        self.model = cls.from_pretrained(folder).eval()
        self.causal = causal
        self.special = set(self.tok.all_special_ids)

    def log_probs(self, windows):
        """log P of each window (one batch: the windows of a site have one length)."""
        batch = [self.tok(w)["input_ids"] for w in windows]
        with torch.no_grad():
            logits = self.model(torch.tensor(batch)).logits.float()
        lp = torch.log_softmax(logits, -1)
        return [sum(lp[r, t - 1, ids[t]].item() for t in range(1, len(ids))
                    if ids[t] not in self.special) for r, ids in enumerate(batch)]

    def log_prob(self, window):
        return self.log_probs([window])[0]

    def masked(self, window, offset, alt):
        ids = self.tok(window)["input_ids"]
        pieces = self.tok.convert_ids_to_tokens(ids)
        start = 0
        for t, (i, p) in enumerate(zip(ids, pieces)):
            if i in self.special and i != self.tok.unk_token_id:
                continue
            length = 1 if i == self.tok.unk_token_id else len(p)
            if offset < start + length:
                if i == self.tok.unk_token_id:
                    return None
                alt_piece = p[: offset - start] + alt + p[offset - start + 1:]
                alt_id = self.tok.convert_tokens_to_ids(alt_piece)
                if alt_id == self.tok.unk_token_id:
                    return None
                masked = list(ids)
                masked[t] = self.tok.mask_token_id
                with torch.no_grad():
                    logits = self.model(torch.tensor([masked])).logits[0, t].float()
                lp = torch.log_softmax(logits, -1)
                return lp[alt_id].item() - lp[i].item()
            start += length
        raise AssertionError("offset past the window")

    def score(self, window, offset, alt, rc):
        def one(w, o, a):
            if self.causal:
                ref_lp, alt_lp = self.log_probs([w, w[:o] + a + w[o + 1:]])
                return alt_lp - ref_lp
            return self.masked(w, o, a)

        s = one(window, offset, alt)
        if not rc or s is None:
            return s
        r = one(revcomp(window), len(window) - 1 - offset, COMP[alt])
        return None if r is None else (s + r) / 2




def read_fasta(path):
    seqs, name = {}, None
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith(">"):
                name = line[1:].split()[0]
                seqs[name] = []
            elif name is not None:
                seqs[name].append(line.upper())
    return {k: "".join(v) for k, v in seqs.items()}


def read_vcf(path):
    out = []
    with open(path) as f:
        for line in f:
            if line.startswith("#"):
                continue
            chrom, pos, _, ref, alts = line.split("\t")[:5]
            out.append((chrom, int(pos) - 1, ref.upper(), alts.upper().split(",")))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--reference", required=True)
    ap.add_argument("--vcf", required=True)
    ap.add_argument("--window", type=int, required=True)
    ap.add_argument("--rc-average", action="store_true")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    genome = read_fasta(args.reference)
    variants = read_vcf(args.vcf)
    causal = "ForCausalLM" in json.load(open(f"{args.model}/config.json"))["architectures"][0]
    ref_model = Reference(args.model, causal)
    start = time.perf_counter()
    rows = []
    for chrom, pos, ref, alts in variants:
        seq = genome[chrom]
        b, e = centred(pos, args.window, len(seq))
        for alt in alts:
            if len(ref) != 1 or len(alt) != 1 or alt not in "ACGT":
                continue
            s = ref_model.score(seq[b:e], pos - b, alt, args.rc_average)
            if s is not None:
                rows.append(f"{chrom}\t{pos + 1}\t{ref}\t{alt}\t{s:.6f}")
    seconds = time.perf_counter() - start
    with open(args.out, "w") as f:
        f.write("chrom\tpos\tref\talt\tscore\n" + "\n".join(rows) + "\n")
    print(json.dumps({"variants": len(rows), "seconds": seconds,
                      "variants_per_s": len(rows) / seconds, "torch": torch.__version__}))


if __name__ == "__main__":
    main()
