#!/usr/bin/env python3
"""Issue 57 item 8: no message a user sees names a C++ identifier.

A refusal names what the user has: an option, a config key, a file, an action ("raise
data.max_bases"), never a C++ field or type ("raise GenomeOptions::max_bases"). A user-facing
message is one raised with an exit code other than ExitCode::kFailure (kFailure is an internal
error, a bug, whose message is for us). This scans every statement of the non-test sources that
names such an exit code and fails on a string literal in it holding a qualified C++ name
(`Type::member`, `ns::function`).

  tests/lint/user_messages.py [--root DIR]        # the tree; exit 1 listing each hit
  tests/lint/user_messages.py --self-test         # the check can fail
"""
import argparse
import pathlib
import re
import sys

DIRS = ("checkpoint", "cluster", "comm", "coordinator", "core", "launcher", "worker")
USER_CODE = re.compile(r"ExitCode::k(?!Failure\b)[A-Z]\w*")
LITERAL = re.compile(r'"((?:[^"\\\n]|\\.)*)"')
QUALIFIED = re.compile(r"\b[A-Za-z_]\w*::~?[A-Za-z_]\w*")


def strip_comments(text):
    """The text with its comments blanked (string literals holding // kept)."""
    out, i = [], 0
    for m in re.finditer(r'"(?:[^"\\\n]|\\.)*"|//[^\n]*|/\*.*?\*/', text, re.S):
        out.append(text[i:m.start()])
        tok = m.group(0)
        out.append(tok if tok.startswith('"') else re.sub(r"[^\n]", " ", tok))
        i = m.end()
    out.append(text[i:])
    return "".join(out)


def hits(text):
    """(line, literal) for each literal naming a C++ identifier in a user-facing statement."""
    code = strip_comments(text)
    # Statements: the text between ; { } outside string literals (good enough for
    # DNALLM_CHECK(...); and throw ...;), found in a copy with the literals blanked.
    masked = LITERAL.sub(lambda m: '"' + "x" * (len(m.group(0)) - 2) + '"', code)
    found = []
    start = 0
    for m in re.finditer(r"[;{}]", masked):
        stmt = code[start:m.start()]
        if USER_CODE.search(stmt):
            for lit in LITERAL.finditer(stmt):
                if QUALIFIED.search(lit.group(1)):
                    line = code.count("\n", 0, start + lit.start()) + 1
                    found.append((line, lit.group(0)))
        start = m.end()
    return found


def scan(root):
    problems = []
    for d in DIRS:
        for path in sorted((root / d).rglob("*")):
            if path.suffix not in (".cpp", ".hpp"):
                continue
            for line, lit in hits(path.read_text(errors="replace")):
                problems.append(f"{path.relative_to(root)}:{line}: {lit}")
    return problems


def self_test():
    bad = ('DNALLM_CHECK(n <= o.max_bases, ExitCode::kUsage,\n'
           '             "more than {} bases; raise GenomeOptions::max_bases", n);\n')
    internal = 'DNALLM_CHECK(ok, ExitCode::kFailure, "AsyncWriter::save before start()");\n'
    good = 'DNALLM_CHECK(n <= m, ExitCode::kUsage, "raise data.max_bases (now {})", m);\n'
    commented = '// ExitCode::kUsage: "Foo::bar"\nint x = 1;\n'
    ok = (hits(bad) == [(2, '"more than {} bases; raise GenomeOptions::max_bases"')]
          and not hits(internal) and not hits(good) and not hits(commented))
    print("user_messages self-test:", "ok" if ok else "FAILED")
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default=pathlib.Path(__file__).resolve().parents[2])
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args()
    if a.self_test:
        return self_test()
    problems = scan(pathlib.Path(a.root))
    for p in problems:
        print(p)
    if problems:
        print(f"user_messages: {len(problems)} user-facing message(s) name a C++ identifier: "
              "name the option, key or action the user has instead", file=sys.stderr)
        return 1
    print("user_messages: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
