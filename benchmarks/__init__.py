"""Benchmarks for omni-requests: hashing, key reuse, per-request overhead, memory, binding.

Run them all with ``python -m benchmarks`` (about 2 minutes on 2 cores) or a CI smoke
run with ``python -m benchmarks --quick`` (under 30 s). Every figure is a ratio against
a baseline measured in the same run, interleaved with it, because shared machines are
noisy. ``docs/benchmarks.md`` explains the method and what the numbers do not show.
"""
