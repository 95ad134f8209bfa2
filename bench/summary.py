"""What the bench scripts' summaries share: the Python each runs on its results
(bench_summary in bench/lib.sh: bench/infer/bench_embed.sh, bench/ddp, bench/zero3,
bench/train)."""
import json
import os


def peer_runs(paths):
    """What a peer printed, one JSON object a run (`paths`: its output file in each round). A run
    that printed nothing failed (the script said so and went on) and is left out."""
    return [json.load(open(p)) for p in paths if os.path.getsize(p) > 0]
