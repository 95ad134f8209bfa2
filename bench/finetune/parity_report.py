#!/usr/bin/env python3
"""The table of bench/finetune/parity.sh: per base, task and mode, each system's test MCC and
accuracy over the seeds (mean +/- sample standard deviation), the Welch t-test of ours against
each peer on MCC (scipy.stats.ttest_ind, equal_var=False; two-sided p, and which side is
higher), the wall time per run, and the task's k-mer baseline (scripts/kmer-baseline.py).

  parity_report.py RESULTS.jsonl TASKS_DIR
"""
import collections
import json
import os
import statistics
import sys


def mean_sd(values):
    m = statistics.fmean(values)
    return m, statistics.stdev(values) if len(values) > 1 else 0.0


def main():
    results, tasks = sys.argv[1], sys.argv[2]
    from scipy.stats import ttest_ind
    rows = [json.loads(line) for line in open(results) if line.strip()]
    groups = collections.defaultdict(list)
    for r in rows:
        groups[(r["base"], r["task"], r["mode"], r["system"])].append(r)
    print("| base | task | mode | system | seeds | test MCC | test accuracy | wall s/run | "
          "p (Welch, MCC vs ours) | k-mer baseline MCC |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    flagged = []
    for key in sorted({k[:3] for k in groups}):
        base, task, mode = key
        kmer_path = os.path.join(tasks, task, "kmer.json")
        kmer = json.load(open(kmer_path))["test_mcc"] if os.path.exists(kmer_path) else None
        ours = [r["test"]["mcc"] for r in groups.get(key + ("ours",), [])]
        for system in ("ours", "hf", "dnallm"):
            runs = groups.get(key + (system,))
            if not runs:
                continue
            mcc = [r["test"]["mcc"] for r in runs]
            acc = [r["test"]["accuracy"] for r in runs]
            wall = statistics.fmean(r["wall_s"] for r in runs)
            p = ""
            if system != "ours" and len(ours) > 1 and len(mcc) > 1:
                t = ttest_ind(ours, mcc, equal_var=False)
                higher = "ours" if statistics.fmean(ours) >= statistics.fmean(mcc) else system
                p = f"{t.pvalue:.3f} ({higher} higher)"
                if higher != "ours" and t.pvalue < 0.05:
                    flagged.append(f"{base}/{task}/{mode}: ours below {system}, p = {t.pvalue:.3f}")
            m, s = mean_sd(mcc)
            am, asd = mean_sd(acc)
            print(f"| {base} | {task} | {mode} | {system} | {len(runs)} | {m:.3f} +/- {s:.3f} | "
                  f"{am:.3f} +/- {asd:.3f} | {wall:.0f} | {p} | "
                  f"{'' if kmer is None else f'{kmer:.3f}'} |")
    print()
    print("ours below a peer with p < 0.05: " + ("; ".join(flagged) if flagged else "none"))


if __name__ == "__main__":
    main()
