"""The other process of tests/wire/test_processes.py: ``python -m tests.wire._peer``.

Reads length-prefixed wire messages on stdin; for each, decodes it, and answers (length
prefixed JSON) with the record's picture (engine dict digest, keys, order) and the record
encoded again, or with the error decoding raised.
"""

from __future__ import annotations

import base64
import json
import struct
import sys

from omni_requests import OmniRequestsError
from omni_requests.wire import decode, encode

from ._plain import picture


def main() -> None:
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    while header := source.read(4):
        (size,) = struct.unpack("<I", header)
        message = source.read(size)
        try:
            record = decode(message)
            answer = {"picture": picture(record), "again": base64.b64encode(encode(record)).decode()}
        except OmniRequestsError as error:
            answer = {"error": type(error).__name__, "path": error.path, "message": error.message}
        out = json.dumps(answer).encode()
        sink.write(struct.pack("<I", len(out)) + out)
        sink.flush()


if __name__ == "__main__":
    main()
