#!/usr/bin/env python3
"""dnallm-infer variants and mutagenesis against the same quantities computed in Python with
transformers on the same Hugging Face directory (Note [Zero-shot variant effects],
worker/infer/variants.hpp), on a causal model (llama_causal) and a masked one (esm_mlm, the
Nucleotide Transformer's 6-mers) of tests/data/hf-fixtures:

- a seeded random reference of two contigs; a VCF with SNVs near both contig ends and inside,
  a multi-allelic site, an indel and a symbolic allele (both skipped and counted);
- every scored row equals transformers' within --tolerance, with and without --rc-average;
- refusals: a REF that disagrees with the reference and a contig missing from it (exit 3
  naming chrom:pos), a plain-gzip reference (exit 3 saying how to bgzip and index it);
- mutagenesis of a region equals the same site scores;
- under dnallm-launch --nproc-per-node 2 (Note [Row shares]) both write the same file as one
  process, byte for byte, and leave no part files.

  python tests/hf/check_variants.py --infer build/bin/dnallm-infer --fixtures tests/data/hf-fixtures
"""
import argparse
import gzip
import os
import random
import subprocess
import sys
import tempfile

from hf_common import checks_exit_code

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "infer"))
from variants_peer import COMP, Reference, centred  # noqa: E402  (the benchmark's peer loop)

def run(cmd):
    return subprocess.run(cmd, capture_output=True, text=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--infer", required=True)
    ap.add_argument("--fixtures", required=True)
    ap.add_argument("--window", type=int, default=60)
    ap.add_argument("--tolerance", type=float, default=1e-4)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="dnallm_variants_")
    rng = random.Random(7)
    genome = {"chr1": "".join(rng.choice("ACGT") for _ in range(300)),
              "chr2": "".join(rng.choice("ACGT") for _ in range(200))}
    fasta = os.path.join(tmp, "ref.fa")
    with open(fasta, "w") as f:
        for name, s in genome.items():
            f.write(f">{name}\n")
            for i in range(0, len(s), 60):
                f.write(s[i:i + 60] + "\n")

    def other(b, k=1):
        return "ACGT"[("ACGT".index(b) + k) % 4]

    # (chrom, 0-based pos, REF, ALTs)
    sites = [("chr1", 3, None, [1]), ("chr1", 150, None, [1, 2]), ("chr1", 151, "indel", None),
             ("chr1", 200, None, [3]), ("chr2", 100, None, [2]), ("chr2", 120, "symbolic", None),
             ("chr2", 199, None, [1])]
    lines = []
    expected_rows = []
    for chrom, pos, kind, alts in sites:
        ref = genome[chrom][pos]
        if kind == "indel":
            lines.append(f"{chrom}\t{pos + 1}\t.\t{genome[chrom][pos:pos + 2]}\t{ref}\t.\t.\t.")
        elif kind == "symbolic":
            lines.append(f"{chrom}\t{pos + 1}\t.\t{ref}\t<DEL>\t.\t.\t.")
        else:
            alt_bases = [other(ref, k) for k in alts]
            lines.append(f"{chrom}\t{pos + 1}\t.\t{ref}\t{','.join(alt_bases)}\t.\t.\t.")
            expected_rows += [(chrom, pos, ref, a) for a in alt_bases]

    def write_vcf(path, body, contigs=("chr1", "chr2")):
        with open(path, "w") as f:
            f.write("##fileformat=VCFv4.2\n")
            for c in contigs:
                f.write(f"##contig=<ID={c}>\n")
            f.write("#CHROM\tPOS\tID\tREF\tALT\tQUAL\tFILTER\tINFO\n")
            f.write("\n".join(body) + "\n")

    vcf = os.path.join(tmp, "v.vcf")
    write_vcf(vcf, lines)
    failures = 0
    for name, causal in [("llama_causal", True), ("esm_mlm", False)]:
        folder = os.path.join(args.fixtures, name)
        ref_model = Reference(folder, causal)
        for rc in (False, True):
            out = os.path.join(tmp, f"{name}_{rc}.tsv")
            cmd = [args.infer, "variants", "--device", "cpu", "--model", folder, "--reference",
                   fasta, "--vcf", vcf, "--window", str(args.window), "--out", out,
                   "--batch-size", "3"] + (["--rc-average"] if rc else [])
            r = run(cmd)
            if r.returncode != 0:
                print(f"FAIL {name} rc={rc}: exit {r.returncode}\n{r.stdout}{r.stderr}")
                failures += 1
                continue
            with open(out) as f:
                rows = [l.rstrip("\n").split("\t") for l in f][1:]
            want = []
            for chrom, pos, ref, alt in expected_rows:
                b, e = centred(pos, args.window, len(genome[chrom]))
                s = ref_model.score(genome[chrom][b:e], pos - b, alt, rc)
                if s is not None:
                    want.append((chrom, pos + 1, ref, alt, s))
            if len(rows) != len(want):
                print(f"FAIL {name} rc={rc}: {len(rows)} rows, transformers scores {len(want)}")
                failures += 1
                continue
            worst = 0.0
            for got, (chrom, pos, ref, alt, s) in zip(rows, want):
                if got[:4] != [chrom, str(pos), ref, alt]:
                    print(f"FAIL {name}: row {got} is not {chrom}:{pos} {ref}>{alt}")
                    failures += 1
                worst = max(worst, abs(float(got[4]) - s))
            ok = worst <= args.tolerance
            failures += 0 if ok else 1
            print(f"{'ok  ' if ok else 'FAIL'} {name} variants rc_average={rc}: {len(rows)} "
                  f"rows, max |ours - transformers| = {worst:.2e}")
        # mutagenesis of chr1 positions 148..152 (1-based 149-153), against the site scores
        out = os.path.join(tmp, f"{name}_mut.tsv")
        r = run([args.infer, "mutagenesis", "--device", "cpu", "--model", folder, "--input",
                 fasta, "--record", "chr1", "--region", "149-153", "--window", str(args.window),
                 "--out", out])
        if r.returncode != 0:
            print(f"FAIL {name} mutagenesis: exit {r.returncode}\n{r.stdout}{r.stderr}")
            failures += 1
        else:
            with open(out) as f:
                rows = [l.rstrip("\n").split("\t") for l in f][1:]
            worst = 0.0
            for row in rows:
                pos = int(row[0]) - 1
                b, e = centred(pos, args.window, 300)
                for k, base in enumerate("ACGT"):
                    if base == row[1]:
                        continue
                    s = ref_model.score(genome["chr1"][b:e], pos - b, base, False)
                    if s is None:
                        worst = max(worst, 0 if row[2 + k] == "NA" else 1)
                    else:
                        worst = max(worst, abs(float(row[2 + k]) - s))
            ok = len(rows) == 5 and worst <= args.tolerance
            failures += 0 if ok else 1
            print(f"{'ok  ' if ok else 'FAIL'} {name} mutagenesis: {len(rows)} positions, "
                  f"max |ours - transformers| = {worst:.2e}")

    # Two ranks under the launcher write what one process writes (Note [Row shares]).
    launch = os.path.join(os.path.dirname(os.path.abspath(args.infer)), "dnallm-launch")
    for what, name, cmd in [
            ("variants", "llama_causal",
             ["variants", "--reference", fasta, "--vcf", vcf, "--rc-average"]),
            ("mutagenesis", "esm_mlm",
             ["mutagenesis", "--input", fasta, "--record", "chr2", "--region", "40-52"])]:
        folder = os.path.join(args.fixtures, name)
        outs = []
        for ranks in (1, 2):
            out = os.path.join(tmp, f"{what}_{ranks}ranks.tsv")
            full = [args.infer] + cmd + ["--device", "cpu", "--model", folder, "--window",
                                         str(args.window), "--batch-size", "2", "--out", out]
            if ranks > 1:
                full = [launch, "--nproc-per-node", str(ranks), "--"] + full
            r = run(full)
            outs.append(open(out).read() if r.returncode == 0 else f"exit {r.returncode}\n"
                        f"{r.stdout}{r.stderr}")
        parts = [f for f in os.listdir(tmp) if ".part" in f or ".tmp." in f]
        rows = outs[0].count("\n") - 1
        ok = outs[0] == outs[1] and rows > 5 and not parts
        failures += 0 if ok else 1
        print(f"{'ok  ' if ok else 'FAIL'} {what} on 2 ranks equals 1 process ({rows} rows)"
              + ("" if ok else f"\n1 rank:\n{outs[0]}\n2 ranks:\n{outs[1]}\nleft: {parts}"))

    # Refusals: one message, exit 3.
    folder = os.path.join(args.fixtures, "llama_causal")
    bad = genome["chr1"][10]
    mismatch = os.path.join(tmp, "mismatch.vcf")
    write_vcf(mismatch, [f"chr1\t11\t.\t{other(bad)}\t{other(bad, 2)}\t.\t.\t."])
    missing = os.path.join(tmp, "missing.vcf")
    write_vcf(missing, [f"chrZ\t5\t.\tA\tC\t.\t.\t."], contigs=("chr1", "chr2", "chrZ"))
    plain_gz = os.path.join(tmp, "ref_plain.fa.gz")
    with open(fasta, "rb") as f, gzip.open(plain_gz, "wb") as g:
        g.write(f.read())
    for what, vcf_file, ref_file, needles in [
            ("REF mismatch", mismatch, fasta, ["chr1:11", f"REF {other(bad)}", f"holds {bad}"]),
            ("missing contig", missing, fasta, ["chrZ", "not in --reference"]),
            ("plain gzip reference", vcf, plain_gz, ["bgzip", "samtools faidx"])]:
        r = run([args.infer, "variants", "--device", "cpu", "--model", folder, "--reference",
                 ref_file, "--vcf", vcf_file, "--out", os.path.join(tmp, "x.tsv")])
        text = r.stdout + r.stderr
        ok = r.returncode == 3 and all(n in text for n in needles)
        failures += 0 if ok else 1
        print(f"{'ok  ' if ok else 'FAIL'} refusal, {what}: exit {r.returncode}"
              + ("" if ok else f"\n{text}"))
    return checks_exit_code(failures, "all variant checks passed")


if __name__ == "__main__":
    sys.exit(main())
