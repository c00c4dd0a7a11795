"""The benchmarks run as scripts (``python bench/<name>.py``), which puts ``bench/`` first on
the import path: a file there named like a standard-library module (``queue.py``) would be
imported in its place by every other benchmark (urllib3 and concurrent.futures import queue)."""

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_no_benchmark_hides_a_standard_library_module():
    names = {p.stem for p in BENCH.glob("*.py")}
    assert names, f"no benchmarks in {BENCH}"
    assert not names & set(sys.stdlib_module_names), names & set(sys.stdlib_module_names)
