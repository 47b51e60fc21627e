"""The benchmarks run (quick mode) and report every figure against a same-run baseline.

Speed is not asserted here: the figures are ratios on a noisy machine, reported by
``python -m benchmarks`` and published in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.vllm  # the hashing suite compares against vLLM's own hasher
def test_quick_run_reports_every_suite(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="the hashing benchmark compares against vLLM")
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    assert "targets missed:" in result.stdout
    report = json.loads(out.read_text())
    rows = report["rows"] if isinstance(report, dict) else report
    suites = {row["suite"] for row in rows}
    assert suites == {
        "hashing",
        "construction",
        "reuse",
        "overhead",
        "memory",
        "binding",
        "wire",
        "frontend",
        "affinity",
    }
    assert all(row["value"] for row in rows)


@pytest.mark.parametrize("n", range(1, 10))
def test_every_candidate_follows_every_other_equally_often(n: int) -> None:
    from collections import Counter
    from itertools import pairwise

    from benchmarks._harness import carryover_balanced

    orders = carryover_balanced(n)
    assert all(sorted(order) == list(range(n)) for order in orders)
    followers = Counter((a, b) for order in orders for a, b in pairwise(order))
    assert set(followers) == {(a, b) for a in range(n) for b in range(n) if a != b}
    assert len(set(followers.values())) <= 1  # each ordered pair equally often
