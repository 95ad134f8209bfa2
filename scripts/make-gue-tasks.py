#!/usr/bin/env python3
"""Makes fine-tuning tasks that are not trivial from the bundled E. coli K-12 genome, in the GUE
layout (DNABERT-2's benchmark: DIR/train.csv, dev.csv, test.csv with the columns
sequence,label), for scripts/gue-finetune.sh and bench/finetune/parity.sh (issue 43).

  scripts/make-gue-tasks.py [--out DIR] [--genome FASTA.gz] [--train N] [--dev N] [--test N]
                            [--seed S]

Genes are found computationally: an open reading frame (ORF) is an ATG followed by in-frame
codons up to the first stop (TAA, TAG, TGA), on either strand, the longest one for each stop
(its first ATG). A "long ORF" has >= 300 codons: in a genome that is almost always a real
gene. Windows are cut from three disjoint regions of the genome: train from its first 80%,
dev from 80-90%, test from the last 10% (no window of one split overlaps another's), at
seeded random offsets, without N, balanced over the labels and shuffled.

Tasks (each folder also gets task.json, which says how it was made):
  ecoli_strand   binary, 60-base windows inside long ORFs, read on the genome's forward
                 strand: label 1 when the gene is on that strand (the window reads sense),
                 0 when on the other (antisense). Windows inside long ORFs of both strands
                 are left out (ambiguous).
  ecoli_coding3  three classes, 80-base windows: 0 non-coding (no ORF of >= 100 codons in
                 any frame of either strand overlaps it), 1 inside a long ORF on the forward
                 strand, 2 inside a long ORF on the reverse strand (and in none of the other).
  species60      binary, 60-base windows of E. coli (0) or S. aureus (1), from the same
                 regions of each genome. The easy control: GC content (51% against 33%)
                 separates most windows, so a tiny model learns it in 20 steps (the CI's
                 parity check, tests/hf/check_finetune_parity.py, uses it for that).

Standard library only; deterministic for a given --seed. The sizes are rows per split, split
evenly over the labels.
"""
import argparse
import gzip
import json
import os
import random
import sys

STOPS = {"TAA", "TAG", "TGA"}
COMPLEMENT = str.maketrans("ACGTN", "TGCAN")
LONG_CODONS = 300
ANY_ORF_CODONS = 100
SPLITS = (("train", 0.0, 0.8), ("dev", 0.8, 0.9), ("test", 0.9, 1.0))


def read_fasta(path):
    with gzip.open(path, "rt") as f:
        return "".join(line.strip() for line in f if not line.startswith(">")).upper()


def orfs(strand_seq, min_codons):
    """[start, end) of each ORF (first ATG to the end of its stop) of >= min_codons codons
    on this strand, in its own coordinates."""
    out = []
    n = len(strand_seq)
    for frame in range(3):
        open_at = -1
        for i in range(frame, n - 2, 3):
            codon = strand_seq[i:i + 3]
            if codon in STOPS:
                if open_at >= 0 and (i + 3 - open_at) // 3 >= min_codons:
                    out.append((open_at, i + 3))
                open_at = -1
            elif open_at < 0 and codon == "ATG":
                open_at = i
    return out


def coverage(n, intervals):
    """A bytearray with 1 on every base inside one of the intervals."""
    cov = bytearray(n)
    for a, b in intervals:
        cov[a:b] = b"\x01" * (b - a)
    return cov


def prefix_sums(cov):
    sums = [0] * (len(cov) + 1)
    total = 0
    for i, c in enumerate(cov):
        total += c
        sums[i + 1] = total
    return sums


def genome_maps(seq):
    """Per-base maps on forward coordinates: inside a long ORF on + / on -, and inside any
    ORF of >= ANY_ORF_CODONS codons on either strand (prefix sums, for window queries)."""
    n = len(seq)
    rc = seq.translate(COMPLEMENT)[::-1]
    plus_long = orfs(seq, LONG_CODONS)
    minus_long = [(n - b, n - a) for a, b in orfs(rc, LONG_CODONS)]
    any_orf = orfs(seq, ANY_ORF_CODONS) + [(n - b, n - a) for a, b in orfs(rc, ANY_ORF_CODONS)]
    return {
        "plus": prefix_sums(coverage(n, plus_long)),
        "minus": prefix_sums(coverage(n, minus_long)),
        "any": prefix_sums(coverage(n, any_orf)),
        "counts": {"long_orfs_forward": len(plus_long), "long_orfs_reverse": len(minus_long),
                   "orfs_100_codons": len(any_orf)},
    }


def inside(sums, a, b):
    return sums[b] - sums[a]


def gene_strand(maps, a, b):
    """"+" when [a, b) lies inside a long ORF on the forward strand and in none on the
    reverse, "-" for the converse, None otherwise."""
    w = b - a
    plus, minus = inside(maps["plus"], a, b), inside(maps["minus"], a, b)
    if plus == w and minus == 0:
        return "+"
    if minus == w and plus == 0:
        return "-"
    return None


def strand_label(maps, a, b):
    return {"+": 1, "-": 0}.get(gene_strand(maps, a, b))


def coding3_label(maps, a, b):
    if inside(maps["any"], a, b) == 0:
        return 0
    return {"+": 1, "-": 2}.get(gene_strand(maps, a, b))


TASKS = {
    "ecoli_strand": {"width": 60, "labels": 2, "label_of": strand_label,
                     "labels_mean": {"0": "gene on the reverse strand (window reads antisense)",
                                     "1": "gene on the forward strand (window reads sense)"}},
    "ecoli_coding3": {"width": 80, "labels": 3, "label_of": coding3_label,
                      "labels_mean": {"0": "non-coding: no ORF of >= 100 codons overlaps it",
                                      "1": "inside a long ORF on the forward strand",
                                      "2": "inside a long ORF on the reverse strand"}},
    "species60": {"width": 60, "labels": 2, "label_of": None,
                  "labels_mean": {"0": "Escherichia coli K-12 MG1655",
                                  "1": "Staphylococcus aureus N315"}},
}


def cut(seq, maps, task, lo, hi, per_label, rng):
    """per_label windows of each label from [lo, hi) of the genome."""
    w, k = task["width"], task["labels"]
    got = {label: [] for label in range(k)}
    seen = set()
    tries = 0
    limit = 200 * per_label * k
    while any(len(v) < per_label for v in got.values()):
        tries += 1
        if tries > limit:
            short = {label: len(v) for label, v in got.items()}
            sys.exit(f"make-gue-tasks: too few windows in [{lo}, {hi}) for {per_label} per label "
                     f"(found {short} in {limit} tries): ask for fewer rows")
        a = rng.randrange(lo, hi - w)
        if a in seen:
            continue
        window = seq[a:a + w]
        if "N" in window:
            continue
        label = task["label_of"](maps, a, a + w)
        if label is None or len(got[label]) >= per_label:
            continue
        seen.add(a)
        got[label].append(window)
    rows = [(s, label) for label, v in got.items() for s in v]
    rng.shuffle(rows)
    return rows


def cut_species(genomes, w, f_lo, f_hi, per_label, rng):
    """per_label windows of each genome (label = its index) from the same fraction of each."""
    rows = []
    for label, g in enumerate(genomes):
        lo, hi = int(len(g) * f_lo), int(len(g) * f_hi)
        seen = set()
        while len(seen) < per_label:
            a = rng.randrange(lo, hi - w)
            if a not in seen and "N" not in g[a:a + w]:
                seen.add(a)
                rows.append((g[a:a + w], label))
    rng.shuffle(rows)
    return rows


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(root, "runs", "gue-tasks"))
    ap.add_argument("--genome", default=os.path.join(root, "data", "ecoli_k12_mg1655.fa.gz"))
    ap.add_argument("--other-genome", default=os.path.join(root, "data", "saureus_n315.fa.gz"),
                    help="species60's label 1")
    ap.add_argument("--train", type=int, default=3072)
    ap.add_argument("--dev", type=int, default=576)
    ap.add_argument("--test", type=int, default=1152)
    ap.add_argument("--seed", type=int, default=43)
    ap.add_argument("--tasks", default=",".join(TASKS), help="comma-separated task names")
    a = ap.parse_args()
    names = [t for t in a.tasks.split(",") if t]
    unknown = [t for t in names if t not in TASKS]
    if unknown:
        sys.exit(f"make-gue-tasks: unknown task {unknown[0]!r} (known: {', '.join(TASKS)})")
    seq = read_fasta(a.genome)
    maps = genome_maps(seq) if any(TASKS[t]["label_of"] for t in names) else {"counts": {}}
    other = read_fasta(a.other_genome) if "species60" in names else None
    sizes = {"train": a.train, "dev": a.dev, "test": a.test}
    for name in names:
        task = TASKS[name]
        rng = random.Random(f"{a.seed}:{name}")
        folder = os.path.join(a.out, name)
        os.makedirs(folder, exist_ok=True)
        for split, f_lo, f_hi in SPLITS:
            per_label = max(1, sizes[split] // task["labels"])
            if task["label_of"]:
                rows = cut(seq, maps, task, int(len(seq) * f_lo), int(len(seq) * f_hi),
                           per_label, rng)
            else:
                rows = cut_species((seq, other), task["width"], f_lo, f_hi, per_label, rng)
            with open(os.path.join(folder, split + ".csv"), "w") as f:
                f.write("sequence,label\n")
                f.writelines(f"{s},{label}\n" for s, label in rows)
        genomes = [a.genome] + ([a.other_genome] if not task["label_of"] else [])
        info = {"task": name, "genomes": [os.path.basename(g) for g in genomes],
                "window": task["width"], "num_labels": task["labels"],
                "labels": task["labels_mean"], "seed": a.seed,
                "rows": {s: (sizes[s] // task["labels"]) * task["labels"] for s in sizes},
                "splits": {s: [lo, hi] for s, lo, hi in SPLITS},
                "long_orf_codons": LONG_CODONS, "noncoding_max_orf_codons": ANY_ORF_CODONS,
                **(maps["counts"] if task["label_of"] else {}),
                "made_by": "scripts/make-gue-tasks.py"}
        with open(os.path.join(folder, "task.json"), "w") as f:
            json.dump(info, f, indent=1)
            f.write("\n")
        print(f"make-gue-tasks: {folder} ({task['labels']} labels, {task['width']}-base windows, "
              f"{info['rows']['train']}/{info['rows']['dev']}/{info['rows']['test']} rows)")


if __name__ == "__main__":
    main()
