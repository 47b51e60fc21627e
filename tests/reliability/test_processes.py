"""Keys and records across processes: hash seeds, pyrsistent's C extension, pickle, msgpack.

Three processes with different ``PYTHONHASHSEED`` build the same records, two with
pyrsistent's C extension and one without (``PYRSISTENT_NO_C_EXTENSION=1``; each process
checks that the variable took). Each writes its records (pickle) and their engine dicts
(msgpack) and prints its keys; then each reads another's files: pickled with the C
extension and read without it, and the other way round.

msgpack: records cross processes by pickle here (through their constructors, stable
across pyrsistent builds; ``omni_requests.wire`` has its own cross-process tests in
``tests/wire``); engines move plain dicts. What a dict transport must keep is shown by the small codec in ``_worker.py``: arrays,
and tuples apart from lists (vLLM reads ``(audio, rate)`` and ``[item, item]``
differently), which plain msgpack merges, as the last test shows.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import PIL
import pytest
from PIL import Image

from omni_requests import MediaHasher, TextPrompt
from omni_requests_vllm import from_vllm, to_vllm

ROOT = Path(__file__).parents[2]
# (PYTHONHASHSEED, C extension on)
CONFIGS = [("0", True), ("1", False), ("4242", True)]


def _run(mode: str, directory: Path, seed: str, c_extension: bool) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYRSISTENT_NO_C_EXTENSION", "PYTHONHASHSEED")}
    env["PYTHONHASHSEED"] = seed
    if not c_extension:
        env["PYRSISTENT_NO_C_EXTENSION"] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "tests.reliability._worker", mode, str(directory)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout)
    assert result["c_extension"] is c_extension and result["hash_seed"] == seed
    return result


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[Path, dict[str, Any]]]:
    out = []
    for seed, c_extension in CONFIGS:
        directory = tmp_path_factory.mktemp(f"seed{seed}-c{int(c_extension)}")
        out.append((directory, _run("write", directory, seed, c_extension)))
    return out


def test_keys_are_identical_across_hash_seeds_and_pyrsistent_builds(
    written: list[tuple[Path, dict[str, Any]]],
) -> None:
    first = written[0][1]
    assert first["keys"] and first["fingerprints"]
    for _, result in written[1:]:
        assert result["keys"] == first["keys"]
        assert result["fingerprints"] == first["fingerprints"]


@pytest.mark.parametrize("source", range(len(CONFIGS)))
def test_records_read_back_in_another_process_equal_and_key_the_same(
    written: list[tuple[Path, dict[str, Any]]], source: int
) -> None:
    # Read by the next config: C extension on -> off, off -> on, on -> on (another seed).
    directory, wrote = written[source]
    seed, c_extension = CONFIGS[(source + 1) % len(CONFIGS)]
    read = _run("read", directory, seed, c_extension)  # the worker checks equality itself
    assert read["keys"] == wrote["keys"]


def test_plain_msgpack_merges_tuples_into_lists_and_changes_the_record() -> None:
    record = TextPrompt(prompt="<sensor>", multi_modal_data={"sensor": (0.5, 16000)})
    sent = to_vllm(record)
    assert from_vllm(sent) == record
    through_msgpack = msgpack.unpackb(msgpack.packb(sent))
    assert from_vllm(through_msgpack) != record  # [0.5, 16000]: read as two items


def test_pickled_records_name_no_pyrsistent_class(written: list[tuple[Path, dict[str, Any]]]) -> None:
    data = (written[0][0] / "records.pickle").read_bytes()
    assert b"pvectorc" not in data and b"pyrsistent" not in data
    assert pickle.loads(data)


@pytest.mark.xfail(
    int(PIL.__version__.split(".", 1)[0]) >= 13,  # 12.3.0 keeps the palette (seen)
    strict=True,
    reason="Pillow 13's pickle drops or rewrites a P image's palette; see the issue 6 report",
)
def test_palette_images_keep_their_key_through_pickle() -> None:
    hasher = MediaHasher("m")
    image = Image.new("RGB", (2, 2)).convert("P")
    assert hasher.key("image", pickle.loads(pickle.dumps(image))) == hasher.key("image", image)
