"""CI's tiers hold together: every extended test is covered in CI by tests that exist and that CI runs, and the
marker reaches exactly the tests ``tests/extended.py`` names."""

import ast
import os
import re
import subprocess
import sys

from extended import EXTENDED

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
NAMED = re.compile(r"tests/(\w+\.py)::(\w+)")


def _functions(file: str) -> set[str]:
    with open(os.path.join(TESTS, file)) as f:
        return {node.name for node in ast.parse(f.read()).body if isinstance(node, ast.FunctionDef)}


def test_every_extended_test_exists_and_names_ci_tests_that_cover_it():
    whole = {key for key in EXTENDED if "[" not in key}  # a test extended in every case
    for key, cover in EXTENDED.items():
        file, name = NAMED.fullmatch(key.split("[")[0]).groups()
        assert name in _functions(file), f"{key}: no such test"
        named = NAMED.findall(cover)
        assert named, f"{key}: its cover names no test (tests/FILE.py::NAME)"
        for cover_file, cover_name in named:
            assert cover_name in _functions(cover_file), f"{key}: its cover tests/{cover_file}::{cover_name} is no test"
            assert f"tests/{cover_file}::{cover_name}" not in whole, (
                f"{key}: its cover tests/{cover_file}::{cover_name} is extended itself")


def test_the_marker_reaches_exactly_the_named_tests():
    files = sorted({key.split("::")[0] for key in EXTENDED})
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "extended",
                          "-p", "no:cacheprovider", *files], cwd=REPO, capture_output=True, text=True, timeout=300)
    collected = {line.strip() for line in out.stdout.splitlines() if "::" in line}
    want = {key for key in EXTENDED if "[" in key}
    assert want <= collected, (want - collected, out.stdout[-2000:], out.stderr[-2000:])
    for node in collected:
        assert node in EXTENDED or node.split("[")[0] in EXTENDED, f"{node} is marked extended but not named"
    for key in EXTENDED:
        assert any(node == key or node.split("[")[0] == key for node in collected), f"{key} did not get the marker"
