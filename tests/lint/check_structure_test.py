#!/usr/bin/env python3
"""scripts/check-structure.py on generated trees: each check passes a clean tree and fails
one with the violation it looks for (so the check on the real tree can fail).

Usage: tests/lint/check_structure_test.py [-v]
"""
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts",
                      "check-structure.py")


class Tree:
    """A temporary source tree: write(path, text), run(*args) -> (exit code, output)."""

    def __init__(self):
        self.root = tempfile.mkdtemp(prefix="check-structure-")

    def write(self, rel, text):
        path = os.path.join(self.root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)

    def run(self, *args):
        r = subprocess.run([sys.executable, SCRIPT, "--root", self.root, "--min-family-names",
                            "1"] + list(args), capture_output=True, text=True)
        return r.returncode, r.stdout + r.stderr

    def remove(self):
        shutil.rmtree(self.root)


class CheckStructureTest(unittest.TestCase):
    def setUp(self):
        self.tree = Tree()
        t = self.tree
        # A clean tree: a.cpp uses b, b knows nothing of a; a registered family "foo".
        t.write("core/a.hpp", '#pragma once\n#include "core/b.hpp"\n')
        t.write("core/a.cpp",
                '#include "core/a.hpp"\n#include <vector>\n#include "gtest/gtest.h"\n')
        t.write("core/b.hpp", "#pragma once\n")
        t.write("core/b.cpp", '#include "b.hpp"\n')  # next to the file, as the compiler does
        t.write("worker/models/foo/foo_model.cpp", 'void f(F& f) { f.name = "foo"; }\n')
        t.write("worker/train/trainer.cpp",
                '// "foo" in a comment, and /* "foo" */ too\nconst char* s = "foobar";\n'
                "char q = '\"'; const char* r = \"\\\"foo\";\n")

    def tearDown(self):
        self.tree.remove()

    def check(self, want_rc, *args):
        """Runs the check on the tree with `args`; its exit code must be `want_rc`. Returns its
        output."""
        rc, out = self.tree.run(*args)
        self.assertEqual(rc, want_rc, out)
        return out

    def test_clean_tree_passes(self):
        out = self.check(0)
        self.assertIn("(a) include cycles: 0", out)
        self.assertIn("(b) family names in worker/parallel, worker/train, worker/infer: 0", out)

    def test_cpp_hpp_cycle_fails_naming_the_chain(self):
        # tokenizer.cpp includes hf_import.hpp and hf_import.cpp includes tokenizer.hpp: no
        # header includes the other, yet the two halves depend on each other.
        t = self.tree
        t.write("worker/data/tokenizer.hpp", "#pragma once\n")
        t.write("worker/data/tokenizer.cpp", '#include "worker/models/hf_import.hpp"\n')
        t.write("worker/models/hf_import.hpp", "#pragma once\n")
        t.write("worker/models/hf_import.cpp", '#include "worker/data/tokenizer.hpp"\n')
        out = self.check(1)
        self.assertIn("include cycle: worker/data/tokenizer.cpp:1 includes "
                      "worker/models/hf_import.hpp -> worker/models/hf_import.cpp:1 includes "
                      "worker/data/tokenizer.hpp", out)

    def test_cycle_through_a_cmake_include_root(self):
        t = self.tree
        t.write("lib/CMakeLists.txt",
                "target_include_directories(lib PUBLIC ${CMAKE_CURRENT_SOURCE_DIR}/include)\n")
        t.write("lib/include/c.hpp", '#pragma once\n#include "core/a.hpp"\n')
        t.write("core/b.hpp", '#pragma once\n#include "c.hpp"\n')  # found in lib/include
        out = self.check(1)
        self.assertIn("include roots: . lib/include", out)
        self.assertIn("core/a.hpp:2 includes core/b.hpp -> core/b.hpp:2 includes lib/include/c.hpp"
                      " -> lib/include/c.hpp:2 includes core/a.hpp", out)

    def test_impl_header_is_its_types_own(self):
        t = self.tree
        t.write("core/server_impl.hpp", '#pragma once\n#include "core/server.hpp"\n')
        t.write("core/server.hpp", "#pragma once\n")
        t.write("core/server.cpp", '#include "core/server_impl.hpp"\n')
        t.write("core/import_detail.hpp", '#pragma once\n#include "core/import.hpp"\n')
        t.write("core/import.hpp", "#pragma once\n")
        t.write("core/import.cpp", '#include "core/import_detail.hpp"\n')
        self.check(0)
        t.write("core/server_helpers.hpp", '#pragma once\n#include "core/server.hpp"\n')
        t.write("core/server.cpp", '#include "core/server_helpers.hpp"\n')
        self.check(1)

    def test_allowlist_accepts_a_listed_cycle_and_only_shrinks(self):
        t = self.tree
        t.write("core/b.cpp", '#include "core/a.hpp"\n')  # a <-> b
        self.assertEqual(t.run()[0], 1)
        t.write("scripts/structure-allowlist.txt", "# today's\ncycle core/b core/a\n")
        self.check(0)
        # A third node joins the circle: fails.
        t.write("core/c.hpp", '#pragma once\n#include "core/a.hpp"\n')
        t.write("core/b.hpp", '#pragma once\n#include "core/c.hpp"\n')
        out = self.check(1)
        self.assertIn("cycle core/a core/b core/c", out)
        # The cycle is gone: the line no longer matches, and says so.
        t.write("core/b.hpp", "#pragma once\n")
        t.write("core/b.cpp", '#include "core/b.hpp"\n')
        out = self.check(1)
        self.assertIn("structure-allowlist.txt:2: 'cycle core/a core/b' no longer occurs", out)

    def test_family_literal_in_generic_code_fails(self):
        t = self.tree
        t.write("worker/parallel/engine.cpp", 'bool f(const S& s) { return s.arch == "foo"; }\n')
        out = self.check(1)
        self.assertIn('worker/parallel/engine.cpp:1: generic code names the model family "foo"',
                      out)
        t.write("scripts/structure-allowlist.txt", 'family worker/parallel/engine.cpp "foo"\n')
        self.check(0)

    def test_family_names_come_from_the_registry_and_model_types(self):
        t = self.tree
        t.write("worker/models/bar.cpp",
                'bool r(J& c) { return has_model_type(c, "barlm") || model_type == "bar2"; }\n'
                'void g(F& f) { f.exported_types = {"bar-x", "bar-y"}; }\n')
        t.write("worker/infer/infer.cpp", 'auto a = "bar2"; auto b = R"(bar-y)";\n')
        out = self.check(1)
        self.assertIn("of 5 names (bar-x bar-y bar2 barlm foo)", out)
        self.assertIn('worker/infer/infer.cpp:1: generic code names the model family "bar2"', out)
        self.assertIn('worker/infer/infer.cpp:1: generic code names the model family "bar-y"', out)

    def test_too_few_family_names_means_the_parser_is_stale(self):
        out = self.check(1, "--min-family-names", "2")  # the tree registers only "foo"
        self.assertIn("found only 1 family names", out)

    def test_limits_report_only_unless_strict(self):
        t = self.tree
        t.write("worker/big.cpp", "int x;\n" * 701)
        t.write("tests/big_test.cpp", "int y;\n" * 900)  # tests are exempt
        out = self.check(0)
        self.assertIn("limit: worker/big.cpp: 701 lines (limit 700)", out)
        self.assertNotIn("tests/big_test.cpp", out)
        self.check(1, "--strict")

    @unittest.skipIf(shutil.which("ctags") is None, "no Universal Ctags")
    def test_long_function_and_main(self):
        t = self.tree
        t.write("tools/main.cpp", "int main() {\n" + "  f();\n" * 40 + "}\n")
        t.write("core/long.cpp", "void g() {\n" + "  f();\n" * 118 + "}\n")  # 120: the limit
        out = self.check(1, "--strict")
        self.assertIn("tools/main.cpp:1: main() is 42 lines (limit 40)", out)
        self.assertNotIn("core/long.cpp", out)
        t.write("core/long.cpp", "void g() {\n" + "  f();\n" * 119 + "}\n")
        rc, out = t.run("--strict")
        self.assertIn("core/long.cpp:1: g() is 121 lines (limit 120)", out)


if __name__ == "__main__":
    unittest.main()
