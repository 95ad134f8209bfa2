#!/usr/bin/env python3
"""Where a build's and a suite's time went (docs/build.md).

  scripts/build-times.py build [BUILD_DIR] [--top N]
      From BUILD_DIR/.ninja_log (default build/): the N slowest steps (compiles, the
      precompiled headers, links), each step's kind, and the total a target, slowest first.
      Each output counts once, at its newest build: ninja appends to the log, so after an
      incremental build the figures mix that build's steps with older ones.
  scripts/build-times.py tests CTEST_OUTPUT [--top N]
      From what ctest printed: the N slowest tests and the time of all of them.

The times are wall seconds of each step as ninja saw it; on 2 cores two steps run at once, so
the sum is about twice the build's wall time.
"""
import argparse
import collections
import os
import re
import subprocess
import sys


def ninja_steps(build_dir):
    """The newest build's steps of a .ninja_log: {output: (seconds, start_ms)}."""
    path = os.path.join(build_dir, ".ninja_log")
    try:
        lines = open(path, encoding="utf-8", errors="replace").read().splitlines()
    except OSError as e:
        sys.exit(f"build-times: cannot read {path}: {e.strerror}; build first (scripts/build.sh)")
    steps = {}
    for line in lines:
        if line.startswith("#"):
            continue
        fields = line.split("\t")
        if len(fields) < 5:
            continue
        start, end, output = int(fields[0]), int(fields[1]), fields[3]
        # A restarted ninja run begins again at 0: the log holds several runs; the newest line
        # of an output is its newest build.
        steps[output] = ((end - start) / 1000.0, start)
    # An output the build no longer makes (a unit since moved into a unity batch) is left out:
    # ninja's own list of the build's outputs says which it makes now.
    try:
        listed = subprocess.run(["ninja", "-C", build_dir, "-t", "targets", "all"], check=True,
                                capture_output=True, text=True).stdout
        current = {line.split(":")[0] for line in listed.splitlines()}
        return {o: v for o, v in steps.items() if o in current}
    except (OSError, subprocess.CalledProcessError):
        return steps


def kind(output):
    if output.endswith((".gch", ".pch")) or "cmake_pch" in output:
        return "pch"
    if output.endswith(".o"):
        return "unity" if "/Unity/unity_" in output else "compile"
    if output.endswith((".a", ".so")) or "/bin/" in output or "." not in os.path.basename(output):
        return "link"
    return "other"


def target_of(output):
    m = re.search(r"CMakeFiles/([^/]+)\.dir/", output)
    if m:
        return m.group(1)
    return os.path.basename(output)


def report_build(build_dir, top):
    steps = ninja_steps(build_dir)
    if not steps:
        sys.exit(f"build-times: {build_dir}/.ninja_log holds no step")
    ranked = sorted(steps.items(), key=lambda kv: -kv[1][0])
    total = sum(s for s, _ in steps.values())
    print(f"{len(steps)} steps, {total:.0f} s if run one after another")
    print(f"\nthe {min(top, len(ranked))} slowest:")
    for output, (secs, _) in ranked[:top]:
        print(f"{secs:8.1f} s  {kind(output):7s} {output}")
    by_kind = collections.Counter()
    for output, (secs, _) in steps.items():
        by_kind[kind(output)] += secs
    print("\nby kind: " + ", ".join(f"{k} {v:.0f} s" for k, v in by_kind.most_common()))
    per_target = collections.defaultdict(lambda: [0.0, 0])
    for output, (secs, _) in steps.items():
        t = per_target[target_of(output)]
        t[0] += secs
        t[1] += 1
    print("\nper target (seconds, steps), slowest first:")
    for name, (secs, count) in sorted(per_target.items(), key=lambda kv: -kv[1][0]):
        if secs >= 1.0:
            print(f"{secs:8.1f} s  {count:4d}  {name}")


def report_tests(path, top):
    pattern = re.compile(r"Test\s+#\d+:\s+(\S+)\s+\.*\s*(\**\S+.*?)\s+([0-9.]+) sec")
    rows = []
    try:
        text = open(path, encoding="utf-8", errors="replace").read()
    except OSError as e:
        sys.exit(f"build-times: cannot read {path}: {e.strerror}")
    for line in text.splitlines():
        m = pattern.search(line)
        if m:
            rows.append((float(m.group(3)), m.group(1), m.group(2).strip()))
    if not rows:
        print(f"build-times: no test result in {path}")
        return
    rows.sort(reverse=True)
    print(f"{len(rows)} tests, {sum(r[0] for r in rows):.0f} s of test time in all;"
          f" the {min(top, len(rows))} slowest:")
    for secs, name, status in rows[:top]:
        print(f"{secs:8.1f} s  {name}  {status}")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    b = sub.add_parser("build", help="compile and link times from .ninja_log")
    b.add_argument("build_dir", nargs="?", default="build")
    b.add_argument("--top", type=int, default=25)
    t = sub.add_parser("tests", help="test durations from ctest's output")
    t.add_argument("ctest_output")
    t.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    if args.what == "build":
        report_build(args.build_dir, args.top)
    else:
        report_tests(args.ctest_output, args.top)


if __name__ == "__main__":
    main()
