"""The modules here are type-checked (mypy --strict in CI) and never run.

pytest's doctest collection would import them, and ``engine_usage`` imports vLLM, which
an environment without it (``make test-core``) lacks: they are not collected.
"""

collect_ignore_glob = ["*.py"]
