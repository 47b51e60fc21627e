from __future__ import annotations

import base64
import json
import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("msgspec")

ROOT = Path(__file__).parents[2]


class Peer:
    """Another Python process that decodes what it is sent and reports what it got."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONHASHSEED": "7"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.wire._peer"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )

    def ask(self, message: bytes) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(struct.pack("<I", len(message)) + message)
        self.process.stdin.flush()
        header = self.process.stdout.read(4)
        assert len(header) == 4, "the peer process died"
        (size,) = struct.unpack("<I", header)
        answer: dict[str, Any] = json.loads(self.process.stdout.read(size))
        if "again" in answer:
            answer["again"] = base64.b64decode(answer["again"])
        return answer

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=30)


@pytest.fixture(scope="session")
def peer() -> Iterator[Peer]:
    process = Peer()
    yield process
    process.close()
