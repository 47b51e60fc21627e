"""Coverage-guided fuzzing of from_vllm with atheris (libFuzzer for Python).

    pip install atheris
    python -m tests.reliability.fuzz_atheris -atheris_runs=100000

The same contract as test_fuzz.py: for any input, from_vllm returns a whole record or
raises one of our errors, and never changes its input. atheris mutates a byte string;
``build`` turns it into a nested prompt-like value (dicts with vLLM's field names,
lists, tuples, arrays, scalars), so the fuzzer explores our checks' branches. A failure
stops the run and prints the input; ``-runs`` is libFuzzer's spelling of the same limit.
"""

from __future__ import annotations

import sys
from typing import Any

import atheris

# Imported inside the block so that atheris instruments them for coverage.
with atheris.instrument_imports():
    import numpy as np

    import omni_requests  # noqa: F401
    import omni_requests_vllm  # noqa: F401

from ._inputs import FIELDS, MODALITIES
from .test_fuzz import fuzz_from_vllm

_DTYPES = ("uint8", "float32", "int64", "bool", "float16", "object")
_KEYS = (*FIELDS, *MODALITIES, "encoder_prompt", "decoder_prompt")


def build(fdp: atheris.FuzzedDataProvider, depth: int = 0) -> Any:
    kind = fdp.ConsumeIntInRange(0, 11 if depth < 4 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return fdp.ConsumeBool()
    if kind == 2:
        return fdp.ConsumeInt(fdp.ConsumeIntInRange(1, 9))
    if kind == 3:
        return fdp.ConsumeFloat()
    if kind == 4:
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 8))
    if kind == 5:
        return fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 8))
    if kind == 6:
        return _array(fdp)
    count = fdp.ConsumeIntInRange(0, 4)
    if kind in (7, 8):
        items = [build(fdp, depth + 1) for _ in range(count)]
        return items if kind == 7 else tuple(items)
    out: dict[Any, Any] = {}
    for _ in range(count):
        key = _KEYS[fdp.ConsumeIntInRange(0, len(_KEYS) - 1)] if kind != 11 else build(fdp, 4)
        try:
            out[key] = build(fdp, depth + 1)
        except TypeError:  # an unhashable key
            continue
    return out


def _array(fdp: atheris.FuzzedDataProvider) -> np.ndarray:
    dtype = np.dtype(_DTYPES[fdp.ConsumeIntInRange(0, len(_DTYPES) - 1)])
    shape = tuple(fdp.ConsumeIntInRange(0, 3) for _ in range(fdp.ConsumeIntInRange(0, 4)))
    size = int(np.prod(shape))
    if dtype.hasobject:
        return np.array([fdp.ConsumeInt(2) for _ in range(size)], dtype).reshape(shape)
    raw = fdp.ConsumeBytes(size * dtype.itemsize).ljust(size * dtype.itemsize, b"\0")
    array = np.frombuffer(raw, dtype).reshape(shape).copy()
    if fdp.ConsumeBool():
        array.flags.writeable = False
    return array


def one_input(data: bytes) -> None:
    fuzz_from_vllm(build(atheris.FuzzedDataProvider(data)))


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
