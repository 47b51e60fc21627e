"""Benchmarks for omni-requests: hashing, construction, key reuse, per-request overhead,
memory, binding, wire, vLLM's frontend, routing; the live engine apart (``benchmarks.engine``).

Run them all with ``python -m benchmarks`` (5 to 10 minutes on 2 cores) or a CI smoke
run with ``python -m benchmarks --quick`` (about a minute). Every figure is a ratio against
a baseline measured in the same run, interleaved with it, because shared machines are
noisy. ``docs/benchmarks.md`` explains the method and what the numbers do not show.
"""
