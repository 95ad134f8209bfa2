#!/usr/bin/env python3
"""The k-mer baseline of a GUE-layout task (issue 43): logistic regression on the counts of
overlapping k-mers (every k from 1 to K, K chosen on dev), scikit-learn, scored on test with
scikit-learn's MCC and accuracy (the definitions dnallm-eval follows: Note [Classification
scores]). What a model must beat to have learned more than composition.

  scripts/kmer-baseline.py TASK_DIR [TASK_DIR...] [--max-k 6] [--json]

Needs scikit-learn (the benchmark environment: scripts/install-deps.sh --bench puts it in
$DNALLM_VENV-dnallm). Prints a line a task (or one JSON object a task with --json).
"""
import argparse
import csv
import itertools
import json
import os
import sys
import time


def load(path):
    with open(path) as f:
        rows = list(csv.DictReader(f))
    return [r["sequence"].upper() for r in rows], [int(r["label"]) for r in rows]


def featurizer(max_k):
    index = {}
    for k in range(1, max_k + 1):
        for kmer in itertools.product("ACGT", repeat=k):
            index["".join(kmer)] = len(index)

    def features(seqs):
        import numpy as np
        x = np.zeros((len(seqs), len(index)), dtype=np.float32)
        for row, s in enumerate(seqs):
            for k in range(1, max_k + 1):
                for i in range(len(s) - k + 1):
                    j = index.get(s[i:i + k])
                    if j is not None:
                        x[row, j] += 1
            x[row] /= max(1, len(s))
        return x
    return features


def fit_score(train, dev, test, max_k):
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import accuracy_score, matthews_corrcoef
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    f = featurizer(max_k)
    model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000, C=0.1))
    model.fit(f(train[0]), train[1])
    scores = {}
    for name, (x, y) in (("dev", dev), ("test", test)):
        pred = model.predict(f(x))
        scores[name] = {"mcc": float(matthews_corrcoef(y, pred)),
                        "accuracy": float(accuracy_score(y, pred))}
    return scores


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tasks", nargs="+")
    ap.add_argument("--max-k", type=int, default=6)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    try:
        import sklearn  # noqa: F401
    except ImportError:
        sys.exit(f"kmer-baseline: {sys.executable} cannot import scikit-learn (scripts/install-deps.sh"
                 " --bench installs it in $DNALLM_VENV-dnallm; or pip install scikit-learn)")
    for task in a.tasks:
        splits = {s: load(os.path.join(task, s + ".csv")) for s in ("train", "dev", "test")}
        t0 = time.perf_counter()
        best = None
        for k in range(1, a.max_k + 1):
            s = fit_score(splits["train"], splits["dev"], splits["test"], k)
            if best is None or s["dev"]["mcc"] > best[1]["dev"]["mcc"]:
                best = (k, s)
        k, s = best
        out = {"task": os.path.basename(os.path.normpath(task)), "max_k": k,
               "dev_mcc": s["dev"]["mcc"], "test_mcc": s["test"]["mcc"],
               "test_accuracy": s["test"]["accuracy"], "seconds": time.perf_counter() - t0}
        if a.json:
            print(json.dumps(out))
        else:
            print(f"{out['task']}: k-mer logistic regression (k = 1..{k}, chosen on dev): test MCC "
                  f"{out['test_mcc']:.3f}, accuracy {out['test_accuracy']:.3f} (dev MCC "
                  f"{out['dev_mcc']:.3f})")


if __name__ == "__main__":
    main()
