#!/usr/bin/env python3
"""Our TensorBoard event files read by TensorBoard's own reader.

Trains a tiny masked LM for a few steps (dnallm-train on configs/quickstart.toml, with
evaluation and checkpoints so every kind of event is written) with
`--set logging.tensorboard_dir=DIR --metrics-file FILE`, then loads DIR with
tensorboard.backend.event_processing.event_accumulator.EventAccumulator (Reload(),
Scalars(tag)) and checks it against the JSON Lines metrics as docs/metrics.md defines the
mapping: every number but `step` of every line is the scalar `<event>/<key>` (a step line's
event is `train`) at the line's step (an event without one takes the step of the line before
it), in order, its value the number rounded to float32; TensorBoard has no other scalar tag,
and every wall time lies within the run. Exits 1 on any difference (and when tensorboard is
not installed: run scripts/install-deps.sh).

  python tests/hf/check_tensorboard.py --train build/bin/dnallm-train --source-dir .
"""
import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import time

from hf_common import checks_exit_code, require

# A tiny model for a few steps; eval and checkpoints at step 3 and the end (step 6).
TINY = ["model.hidden=32", "model.layers=2", "model.heads=2", "model.ffn=64",
        "model.max_seq_length=64", "training.micro_batch_size=8", "training.max_steps=6",
        "training.logging_steps=2", "training.eval_steps=3", "training.eval_batches=1",
        "checkpoint.save_steps=3"]


def float32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def expected_scalars(lines):
    """{tag: [(step, value)]} as docs/metrics.md maps the JSON Lines onto TensorBoard."""
    want, step = {}, 0
    for event in lines:
        kind = event.get("event", "train")
        if isinstance(event.get("step"), int) and not isinstance(event["step"], bool):
            step = event["step"]
        for key, value in event.items():
            # bool is an int in Python; JSON's true/false are not numbers.
            if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            want.setdefault(f"{kind}/{key}", []).append((step, value))
    return want


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--train", required=True, help="the dnallm-train binary")
    ap.add_argument("--source-dir", required=True, help="the repository (configs/, data/)")
    ap.add_argument("--keep", help="work here (kept) instead of a temporary directory")
    args = ap.parse_args()
    (tensorboard,) = require("tensorboard")
    from tensorboard.backend.event_processing import event_accumulator

    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or tmp
        os.makedirs(work, exist_ok=True)
        tb_dir, metrics = os.path.join(work, "tb"), os.path.join(work, "metrics.jsonl")
        cmd = [os.path.abspath(args.train), "--config", "configs/quickstart.toml",
               "--set", f"checkpoint.dir={os.path.join(work, 'ck')}",
               "--set", f"logging.tensorboard_dir={tb_dir}", "--metrics-file", metrics]
        for s in TINY:
            cmd += ["--set", s]
        start = time.time()
        run = subprocess.run(cmd, cwd=args.source_dir, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        end = time.time()
        if run.returncode != 0:
            print(" ".join(cmd), "\n", run.stdout)
            print(f"FAIL: dnallm-train exited with {run.returncode}")
            return 1
        with open(metrics) as f:
            lines = [json.loads(line) for line in f if line.strip()]
        want = expected_scalars(lines)

        acc = event_accumulator.EventAccumulator(
            tb_dir, size_guidance={event_accumulator.SCALARS: 0})  # 0: keep every event
        acc.Reload()
        print(f"tensorboard {tensorboard.__version__}: {len(lines)} metrics lines, "
              f"{sum(len(v) for v in want.values())} scalars in {len(want)} tags expected")
        failures = []
        got_tags = set(acc.Tags()["scalars"])
        if got_tags != set(want):
            failures.append(f"tags differ: only in TensorBoard {sorted(got_tags - set(want))}, "
                            f"only in the metrics file {sorted(set(want) - got_tags)}")
        for kind in ("train", "eval", "checkpoint", "memory", "summary"):
            if not any(t.startswith(kind + "/") for t in want):
                failures.append(f"the run wrote no {kind} event: the test lost its coverage")
        for tag in sorted(set(want) & got_tags):
            got = [(e.step, e.value, e.wall_time) for e in acc.Scalars(tag)]
            expected = want[tag]
            if [s for s, _, _ in got] != [s for s, _ in expected]:
                failures.append(f"{tag}: steps {[s for s, _, _ in got]}, metrics file "
                                f"{[s for s, _ in expected]}")
                continue
            for (step, value, wall), (_, number) in zip(got, expected):
                # simple_value is a float: the number rounded to float32, nothing more.
                if value != float32(number):
                    failures.append(f"{tag} step {step}: TensorBoard {value!r}, metrics file "
                                    f"{number!r}")
                if not start - 1 <= wall <= end + 1:
                    failures.append(f"{tag} step {step}: wall time {wall} outside the run "
                                    f"[{start:.0f}, {end:.0f}]")
            print(f"ok   {tag}: steps {[s for s, _, _ in got]}")
        for f in failures:
            print(f"FAIL {f}")
        return checks_exit_code(len(failures))


if __name__ == "__main__":
    sys.exit(main())
