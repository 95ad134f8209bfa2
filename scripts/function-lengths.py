#!/usr/bin/env python3
"""Function-length distribution of the project's C++ sources (a maintenance report).

Usage: scripts/function-lengths.py [--top N] [PATH...]   (default: the git-tracked .cpp files)

Lengths are line counts from the opening line to the closing brace, as Universal Ctags
reports them (`ctags --fields=+ne`); lambdas are counted inside their enclosing function,
not on their own. Prints the N longest functions and how many exceed 60/100/200 lines.
"""
import argparse
import json
import subprocess
import sys


def functions(paths):
    out = subprocess.run(
        ["ctags", "--languages=C++", "--kinds-C++=f", "--fields=+ne", "--output-format=json",
         "-f", "-"] + paths, check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        tag = json.loads(line)
        if "end" not in tag or tag["name"].startswith("__anon"):
            continue
        scope = tag.get("scope", "")
        name = f"{scope}::{tag['name']}" if scope else tag["name"]
        yield tag["end"] - tag["line"] + 1, f"{tag['path']}:{tag['line']}", name


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("paths", nargs="*")
    args = parser.parse_args()
    paths = args.paths or subprocess.run(
        ["git", "ls-files", "*.cpp"], check=True, capture_output=True, text=True).stdout.split()
    rows = sorted(functions(paths), reverse=True)
    for length, where, name in rows[:args.top]:
        print(f"{length:5d}  {name}  ({where})")
    mains = [r for r in rows if r[2] == "main" and not r[1].startswith("tests/")]
    print(f"functions: {len(rows)}; over 60 lines: {sum(r[0] > 60 for r in rows)}; "
          f"over 100: {sum(r[0] > 100 for r in rows)}; over 200: {sum(r[0] > 200 for r in rows)}; "
          f"longest non-test main(): {mains[0][0] if mains else 0} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
