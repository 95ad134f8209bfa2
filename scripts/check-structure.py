#!/usr/bin/env python3
"""Structure checks of the C++ tree (issue 42: a codebase a newcomer can carry).

Usage: scripts/check-structure.py [--root DIR] [--allowlist FILE] [--strict]

  (a) no #include cycle among the project's own files. A file's `#include "..."` lines are
      resolved as the compiler does: next to the file, then against the include roots that
      the CMakeLists.txt files give target_include_directories (${PROJECT_SOURCE_DIR},
      ${CMAKE_CURRENT_SOURCE_DIR}/...). A .cpp and its .hpp are one node (and X_impl.hpp or
      X_detail.hpp, the private header of X, is X's): A.cpp including B.hpp while B.cpp includes A.hpp is a
      cycle (the two halves depend on each other).
  (b) no generic code names a model family: no string literal under worker/parallel,
      worker/train or worker/infer equals a registered family name, model.arch spelling or
      model_type (read from worker/models/ and core/config/spellings.hpp).
  (c) limits: no non-test source file over 700 lines, no non-test function over 120 lines,
      no main() over 40 lines (function lengths: scripts/function-lengths.py, Universal
      Ctags). Report-only unless --strict.

(a) and (b) fail (exit 1) unless the violation is in the allowlist (default
scripts/structure-allowlist.txt): today's violations, each to be removed, never added to.
An allowlist entry that no longer matches fails too, so that the list only shrinks.
Exit codes: 0 clean, 1 violations, 2 bad usage or allowlist.
"""
import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys

SOURCE_EXTENSIONS = (".cpp", ".hpp", ".h", ".cc", ".cu", ".cuh")
GENERIC_DIRS = ("worker/parallel", "worker/train", "worker/infer")
PRIVATE_HEADER_SUFFIXES = ("_impl", "_detail")
MAX_FILE_LINES = 700
MAX_FUNCTION_LINES = 120
MAX_MAIN_LINES = 40
# Fewer names than this means the family parser no longer understands worker/models/.
MIN_FAMILY_NAMES = 8


def source_files(root):
    """The project's C++ files, relative to root: git's view where root is a checkout
    (tracked and untracked-but-not-ignored), else every file below root outside hidden and
    build* folders."""
    if os.path.exists(os.path.join(root, ".git")):
        out = subprocess.run(["git", "-C", root, "ls-files", "--cached", "--others",
                              "--exclude-standard"], check=True, capture_output=True,
                             text=True).stdout.split("\n")
        files = [f for f in out if f.endswith(SOURCE_EXTENSIONS)]
        return sorted(f for f in set(files) if os.path.isfile(os.path.join(root, f)))
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and not d.startswith("build")]
        for name in filenames:
            if name.endswith(SOURCE_EXTENSIONS):
                files.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(files)


def read(root, rel):
    with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
        return f.read()


# ------------------------------------------------------------------ (a) include cycles

INCLUDE_DIRS_RE = re.compile(r"target_include_directories\s*\(([^)]*)\)", re.S)


def include_roots(root):
    """Include folders (relative to root) named by target_include_directories; always "."."""
    roots = ["."]
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and not d.startswith("build")]
        if "CMakeLists.txt" not in filenames:
            continue
        text = read(root, os.path.relpath(os.path.join(dirpath, "CMakeLists.txt"), root))
        for args in INCLUDE_DIRS_RE.findall(text):
            for token in args.split():
                if token.startswith("${PROJECT_SOURCE_DIR}"):
                    path = os.path.join(root, token[len("${PROJECT_SOURCE_DIR}"):].lstrip("/"))
                elif token.startswith("${CMAKE_CURRENT_SOURCE_DIR}"):
                    path = os.path.join(dirpath,
                                        token[len("${CMAKE_CURRENT_SOURCE_DIR}"):].lstrip("/"))
                else:
                    continue  # a variable (LibTorch's folders), a keyword, a target
                rel = os.path.normpath(os.path.relpath(path, root))
                if rel not in roots and not rel.startswith(".."):
                    roots.append(rel)
    return roots


INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


def node_of(rel):
    """A .cpp and its .hpp are one node: the path without its extension. A header X_impl.hpp
    or X_detail.hpp is the private half of X (a unit implemented over several files, e.g.
    coordinator/store_server_impl.hpp): it belongs to X's node too."""
    stem, ext = os.path.splitext(rel)
    for suffix in PRIVATE_HEADER_SUFFIXES:
        if ext in (".hpp", ".h", ".cuh") and stem.endswith(suffix):
            return stem[:-len(suffix)]
    return stem


def include_graph(root, files, roots):
    """{node: {node: (file, line, included file)}}: the first #include that makes each edge."""
    known = set(files)
    graph = {node_of(f): {} for f in files}
    for f in files:
        text = read(root, f)
        for m in INCLUDE_RE.finditer(text):
            target = None
            for base in [os.path.dirname(f)] + roots:
                candidate = os.path.normpath(os.path.join(base, m.group(1)))
                if candidate in known:
                    target = candidate
                    break
            if target is None or node_of(target) == node_of(f):
                continue  # not ours (a library's header), or a file's own header
            line = text.count("\n", 0, m.start()) + 1
            graph[node_of(f)].setdefault(node_of(target), (f, line, target))
    return graph


def strongly_connected(graph):
    """Tarjan's algorithm, iterative: the components with more than one node."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return sorted(out)


def cycle_in(graph, component):
    """A shortest cycle through the component's first node, as a list of nodes."""
    members = set(component)
    start = component[0]
    previous = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child not in members:
                    continue
                if child == start:
                    path = [node]
                    while previous[path[-1]] is not None:
                        path.append(previous[path[-1]])
                    return list(reversed(path)) + [start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    return [start]


def describe_cycle(graph, component):
    chain = cycle_in(graph, component)
    steps = []
    for a, b in zip(chain, chain[1:]):
        f, line, target = graph[a][b]
        steps.append(f"{f}:{line} includes {target}")
    text = " -> ".join(steps)
    if len(component) > len(chain) - 1:
        text += f" (the circle holds {len(component)} nodes: {' '.join(component)})"
    return text


# ------------------------------------------------------------------ (b) family names

# "..." or R"d(...)d" string literals and comments, for a minimal C++ lexer.
TOKEN_RE = re.compile(
    r'//[^\n]*|/\*.*?\*/|R"([^(\s]*)\((.*?)\)\1"|"((?:[^"\\\n]|\\.)*)"|\'(?:[^\'\\\n]|\\.)*\'',
    re.S)


def string_literals(text):
    """(line, value) of every string literal outside comments (escapes left as written)."""
    for m in TOKEN_RE.finditer(text):
        if m.group(0).startswith(("//", "/*", "'")):
            continue
        value = m.group(2) if m.group(0).startswith("R") else m.group(3)
        yield text.count("\n", 0, m.start()) + 1, value


def family_names(root, files):
    """Every name a model family is known by: the registered family names (ModelFamily::name),
    the model_type values of our exports and of the Hugging Face layouts each family
    recognises, and the model.arch spellings."""
    names = set()
    patterns = [
        re.compile(r'\.name\s*=\s*"([^"]+)"'),
        re.compile(r'has_model_type\([^,]*,\s*"([^"]+)"\)'),
        re.compile(r'model_type\s*[!=]=\s*"([^"]+)"'),
    ]
    exported = re.compile(r"exported_types\s*=\s*\{([^}]*)\}")
    for f in files:
        if not f.startswith("worker/models/"):
            continue
        text = read(root, f)
        for p in patterns:
            names.update(p.findall(text))
        for group in exported.findall(text):
            names.update(re.findall(r'"([^"]+)"', group))
    for f in files:  # the model.arch spelling table (core/config/spellings.hpp)
        if f.startswith("core/"):
            names.update(re.findall(r'\{Arch::k\w+,\s*"([^"]+)"\}', read(root, f)))
    return names


def family_literals(root, files, names):
    """(file, line, literal) for each family name written as a literal in generic code."""
    for f in files:
        if not f.startswith(tuple(d + "/" for d in GENERIC_DIRS)):
            continue
        for line, value in string_literals(read(root, f)):
            if value in names:
                yield f, line, value


# ------------------------------------------------------------------ (c) limits

def load_function_lengths(root):
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "function-lengths.py")
    spec = importlib.util.spec_from_file_location("function_lengths", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def limit_violations(root, files):
    """Lines describing each file, function and main() over its limit (tests/ excepted)."""
    out = []
    sources = [f for f in files if not f.startswith("tests/")]
    for f in sources:
        n = read(root, f).count("\n")
        if n > MAX_FILE_LINES:
            out.append(f"{f}: {n} lines (limit {MAX_FILE_LINES})")
    if shutil.which("ctags") is None:
        return out, "no ctags (Universal Ctags) on PATH: function lengths not checked"
    module = load_function_lengths(root)
    cwd = os.getcwd()
    try:
        os.chdir(root)  # function-lengths.py reports paths as given
        rows = sorted(module.functions([f for f in sources if f.endswith((".cpp", ".cc", ".cu"))]),
                      reverse=True)
    finally:
        os.chdir(cwd)
    for length, where, name in rows:
        limit = MAX_MAIN_LINES if name == "main" else MAX_FUNCTION_LINES
        if length > limit:
            out.append(f"{where}: {name}() is {length} lines (limit {limit})")
    return out, None


# ------------------------------------------------------------------ allowlist

def read_allowlist(path):
    """{("cycle", "node node ..."), ("family", "file literal")}, with the line of each."""
    entries = {}
    if not path or not os.path.exists(path):
        return entries
    with open(path, encoding="utf-8") as f:
        for number, raw in enumerate(f, 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            kind, _, rest = line.partition(" ")
            fields = rest.split()
            if kind == "cycle" and len(fields) >= 2:
                entries[("cycle", " ".join(sorted(fields)))] = number
            elif kind == "family" and len(fields) == 2:
                entries[("family", " ".join(fields))] = number
            else:
                print(f"{path}:{number}: expected 'cycle NODE NODE...' or 'family FILE LITERAL'",
                      file=sys.stderr)
                sys.exit(2)
    return entries


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=os.path.join(os.path.dirname(__file__), ".."))
    parser.add_argument("--allowlist", default=None,
                        help="default: ROOT/scripts/structure-allowlist.txt")
    parser.add_argument("--strict", action="store_true", help="(c) limits fail too")
    parser.add_argument("--min-family-names", type=int, default=MIN_FAMILY_NAMES,
                        help="(b) fewer names found in worker/models/ is an error (the parser "
                        "needs updating)")
    args = parser.parse_args()
    root = os.path.abspath(args.root)
    allowlist_path = args.allowlist or os.path.join(root, "scripts", "structure-allowlist.txt")
    allowed = read_allowlist(allowlist_path)
    used = set()
    failures = 0
    files = source_files(root)

    roots = include_roots(root)
    graph = include_graph(root, files, roots)
    cycles = strongly_connected(graph)
    allowed_cycles = {k: set(k[1].split()) for k in allowed if k[0] == "cycle"}
    for component in cycles:
        key = ("cycle", " ".join(component))
        within = [k for k, members in allowed_cycles.items() if set(component) <= members]
        if within:
            if key in allowed:
                used.add(key)
            else:
                print(f"include cycle, smaller than its allowlist entry (line "
                      f"{allowed[within[0]]}): write it as: cycle {key[1]}")
            continue
        failures += 1
        print(f"include cycle: {describe_cycle(graph, component)}")
        print(f"  break it, or (only for an existing one) allowlist it: cycle {key[1]}")
    print(f"(a) include cycles: {len(cycles)} ({len(files)} files, include roots: "
          f"{' '.join(roots)})")

    names = family_names(root, files)
    if any(f.startswith("worker/models/") for f in files) and len(names) < args.min_family_names:
        print(f"(b) found only {len(names)} family names in worker/models/ ({sorted(names)}); "
              "the parser in scripts/check-structure.py needs updating", file=sys.stderr)
        failures += 1
    hits = list(family_literals(root, files, names))
    for f, line, value in hits:
        key = ("family", f'{f} "{value}"')
        if key in allowed:
            used.add(key)
            continue
        failures += 1
        print(f'{f}:{line}: generic code names the model family "{value}": ask the model '
              "(Note [Model registry], worker/models/) instead")
    print(f"(b) family names in {', '.join(GENERIC_DIRS)}: {len(hits)} literal(s) "
          f"of {len(names)} names ({' '.join(sorted(names))})")

    for key, number in sorted(allowed.items(), key=lambda kv: kv[1]):
        if key not in used:
            failures += 1
            print(f"{allowlist_path}:{number}: '{key[0]} {key[1]}' no longer occurs (or has "
                  "changed): remove or update the line, the list only shrinks")

    limits, note = limit_violations(root, files)
    for line in limits:
        print(f"limit: {line}")
    if note:
        print(f"(c) {note}")
    print(f"(c) limits ({MAX_FILE_LINES} lines a file, {MAX_FUNCTION_LINES} a function, "
          f"{MAX_MAIN_LINES} a main()): {len(limits)} over{'' if args.strict else ', report only'}")
    if args.strict and (limits or note):
        failures += len(limits) + (1 if note else 0)

    if failures:
        print(f"check-structure: {failures} problem(s)", file=sys.stderr)
        return 1
    print("check-structure: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
