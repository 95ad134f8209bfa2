#!/usr/bin/env python3
"""Composition baselines for the E. coli (0) vs S. aureus (1) window task of
scripts/finetune-demo.sh, to judge the fine-tuned classifier against what base composition
alone can do. Standard library only.
  scripts/finetune-baselines.py [TRAIN.csv] [EVAL.csv]
Prints held-out accuracy of (1) a GC-content threshold chosen on the training windows and
(2) order-k Markov-chain classifiers (k = 0..5, add-one smoothing) trained on the training
windows, plus how many label-0 evaluation windows are AT-rich (GC < 0.42)."""
import collections
import math
import sys

train_path = sys.argv[1] if len(sys.argv) > 1 else "runs/finetune-data/ecoli_vs_saureus_train.csv"
eval_path = sys.argv[2] if len(sys.argv) > 2 else "runs/finetune-data/ecoli_vs_saureus_eval.csv"


def load(path):
    rows = []
    with open(path) as f:
        next(f)
        for line in f:
            seq, label = line.strip().rsplit(",", 1)
            rows.append((seq, int(label)))
    return rows


def gc(seq):
    return (seq.count("G") + seq.count("C")) / len(seq)


train, held = load(train_path), load(eval_path)
# GC threshold: the cut between the classes that is best on the training windows.
best = max((sum((gc(s) < t) == (y == 1) for s, y in train), t)
           for t in [i / 200 for i in range(60, 120)])[1]
acc = sum((gc(s) < best) == (y == 1) for s, y in held) / len(held)
at_rich = sum(1 for s, y in held if y == 0 and gc(s) < 0.42)
n0 = sum(1 for _, y in held if y == 0)
print(f"label-0 eval windows with GC < 0.42: {at_rich} of {n0}")
print(f"GC threshold {best:.3f}: accuracy {acc:.3f}")
for k in range(6):
    counts = [collections.Counter(), collections.Counter()]
    for s, y in train:
        for i in range(k, len(s)):
            counts[y][s[i - k:i + 1]] += 1
    context = [collections.Counter(), collections.Counter()]
    for y in (0, 1):
        for kmer, c in counts[y].items():
            context[y][kmer[:-1]] += c
    correct = 0
    for s, y in held:
        ll = [sum(math.log((counts[c][s[i - k:i + 1]] + 1) / (context[c][s[i - k:i]] + 4))
                  for i in range(k, len(s))) for c in (0, 1)]
        correct += (ll[1] > ll[0]) == (y == 1)
    print(f"order-{k} Markov classifier: accuracy {correct / len(held):.3f}")
