#!/usr/bin/env python3
"""Sums a LibTorch profiler trace (dnallm-bench-hyena --profile FILE; Chrome's trace format) per
operator: calls, total and self milliseconds (self: minus the operators it called), largest self
time first.
  bench/hyena/profile_summary.py FILE [--top 30]"""
import argparse
import collections
import json


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    with open(args.trace) as f:
        events = [e for e in json.load(f) if e.get("ph") == "X"]
    by_thread = collections.defaultdict(list)
    for e in events:
        by_thread[e.get("tid")].append(e)
    calls = collections.Counter()
    total = collections.Counter()
    self_time = collections.Counter()
    wall = 0.0
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []  # [event, time spent in children]
        for e in evs:
            while stack and stack[-1][0]["ts"] + stack[-1][0]["dur"] <= e["ts"]:
                done, children = stack.pop()
                self_time[done["name"]] += done["dur"] - children
            if stack:
                stack[-1][1] += e["dur"]
            else:
                wall += e["dur"]
            calls[e["name"]] += 1
            total[e["name"]] += e["dur"]
            stack.append([e, 0.0])
        for done, children in stack:
            self_time[done["name"]] += done["dur"] - children
    print(f"{'operator':60s} {'calls':>6s} {'total ms':>10s} {'self ms':>10s} {'self %':>7s}")
    for name, t in self_time.most_common(args.top):
        print(f"{name[:60]:60s} {calls[name]:6d} {total[name] / 1e3:10.1f} {t / 1e3:10.1f} "
              f"{100 * t / wall:6.1f}%")
    print(f"{'(top-level operators, all threads)':60s} {'':6s} {wall / 1e3:10.1f}")


if __name__ == "__main__":
    main()
