"""The integration guide's examples run, and the routing benchmark runs and shows what it claims."""

from __future__ import annotations

import doctest
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "engine-integration.md"
BENCH = ROOT / "benchmarks" / "bench_routing.py"


def test_every_example_of_the_engine_integration_guide_runs() -> None:
    result = doctest.testfile(str(GUIDE), module_relative=False, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.failed == 0
    assert result.attempted >= 40  # the examples were found, not skipped


def test_the_guide_covers_the_before_and_after_and_every_pass_through_case() -> None:
    text = GUIDE.read_text()
    for heading in (
        "## Before:",
        "## After: `scope_stage0`",
        "### When nothing is scoped",
        "## The chat path",
    ):
        assert heading in text
    for case in (
        "one live replica",
        "diffusion stage",
        "engine request",
        "`multi_modal_data`",
        "serviceable",
    ):
        assert case in text


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_routing", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_routing"] = module
    spec.loader.exec_module(module)
    return module


def test_the_lru_model_evicts_the_least_recently_used_key(bench: ModuleType) -> None:
    cache = bench.LRU(2)
    assert [cache.lookup(k) for k in ("a", "b", "a", "c", "b", "a")] == [
        False,
        False,
        True,
        False,
        False,
        False,
    ]
    assert list(cache.keys) == ["b", "a"]


def test_the_benchmark_prints_each_policy_and_affinity_beats_round_robin(
    bench: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    results = bench.main(["--requests", "3000", "--media", "600", "--capacity", "48", "--replicas", "2", "4"])
    out = capsys.readouterr().out
    assert "hit rate" in out and "requests per replica" in out
    for replicas in (2, 4):
        rows = results[replicas]
        assert set(rows) == {"round-robin", "cache-affinity", "affinity, bounded 1.25"}
        for row in rows.values():
            assert len(row["shares"]) == replicas and abs(sum(row["shares"]) - 1) < 1e-9
        assert rows["round-robin"]["max_over_mean"] < 1.01
        assert rows["cache-affinity"]["hit_rate"] > rows["round-robin"]["hit_rate"] + 0.03
        assert rows["affinity, bounded 1.25"]["max_over_mean"] < rows["cache-affinity"]["max_over_mean"]
        assert f"{replicas:>8}  cache-affinity" in out
