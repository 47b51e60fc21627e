"""The ``omni-requests`` command: the template-reuse demo, and vLLM content keys of files."""

from __future__ import annotations

import argparse
import io
import os
import stat
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import __version__
from ._errors import OmniRequestsError
from ._hashing import ALGORITHMS, MediaHasher

__all__ = ["main"]

_MODALITY_BY_NDIM = {1: "audio", 3: "image", 4: "video"}
_MODALITIES = ("image", "video", "audio")
_MAX_BYTES = 1 << 30
_MAX_PIXELS = 1 << 28


def _read(name: str) -> bytes:
    """A file's bytes (``-``: standard input), refusing what is no regular file rather than waiting on it."""
    if name == "-":
        data = sys.stdin.buffer.read(_MAX_BYTES + 1)
    else:
        fd = os.open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError("not a regular file (a FIFO, device or folder)")
            with os.fdopen(fd, "rb", closefd=False) as file:
                data = file.read(_MAX_BYTES + 1)
        finally:
            os.close(fd)
    if len(data) > _MAX_BYTES:
        raise ValueError(f"larger than {_MAX_BYTES} bytes")
    return data


def _npy(data: bytes) -> np.ndarray[Any, Any]:
    from numpy.lib import format as numpy_format

    npy: Any = numpy_format
    buffer = io.BytesIO(data)
    version = npy.read_magic(buffer)
    if version not in ((1, 0), (2, 0)):
        raise ValueError(f"unsupported .npy format version {version}")
    read_header = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
    shape, _, dtype = read_header(buffer)
    if dtype.hasobject:
        raise ValueError("a .npy array of Python objects cannot be loaded safely")
    if int(np.prod(shape, dtype=object)) * dtype.itemsize > len(data) - buffer.tell():
        raise ValueError(f"the .npy header declares shape {shape}, more than its bytes hold")
    array: np.ndarray[Any, Any] = np.load(io.BytesIO(data), allow_pickle=False)
    return array


def _keys(hasher: MediaHasher, data: bytes, modality: str | None) -> list[tuple[str, str]]:
    """(label, key) of one file: as an array, or as an image's server key and pixel key."""
    if data[:6] == b"\x93NUMPY":
        array = _npy(data)
        chosen = modality or _MODALITY_BY_NDIM.get(array.ndim)
        if chosen is None:
            raise ValueError(f"cannot tell the modality of a {array.ndim}-d array; pass --modality")
        return [("array", hasher.key(chosen, array))]
    if modality not in (None, "image"):
        raise ValueError(f"only images and .npy arrays are read, not {modality} files")
    try:
        from PIL import Image
    except ImportError:
        raise ValueError("image files need Pillow: pip install 'omni-requests[images]'") from None
    with Image.open(io.BytesIO(data)) as probe:  # the header alone: refuse bombs before decoding
        width, height = probe.size
    if width * height > _MAX_PIXELS:
        raise ValueError(f"the image has {width}x{height} pixels, more than {_MAX_PIXELS}")
    keys = []
    try:
        from vllm.multimodal.media import ImageMediaIO
    except ImportError:
        pass
    else:  # what vLLM's server loads from this file in a request, keyed by the file's bytes
        keys.append(("server", hasher.key("image", ImageMediaIO().load_bytes(data))))
    with Image.open(io.BytesIO(data)) as image:
        image.load()
        keys.append(("pixels", hasher.content_key("image", image.copy())))
    return keys


def _key(args: argparse.Namespace) -> int:
    hasher = MediaHasher(args.model, args.algorithm)
    status = 0
    for name in args.files:
        try:
            for label, key in _keys(hasher, _read(name), args.modality):
                print(f"{key}  {name}  [{label}]")
        except Exception as error:  # noqa: BLE001 - one line per bad file, never a traceback
            print(f"omni-requests: {name}: {type(error).__name__}: {error}", file=sys.stderr)
            status = 1
    return status


def _demo(_: argparse.Namespace) -> int:
    from ._demo import format_demo, run_demo

    dict_rows, record_rows = run_demo()
    print(format_demo(dict_rows, record_rows), end="")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omni-requests", description=__doc__)
    parser.add_argument("--version", action="version", version=f"omni-requests {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run the template-reuse scenario with dicts and with records")
    demo.set_defaults(run=_demo)
    key = commands.add_parser(
        "key",
        help="print vLLM's content keys of image files and .npy arrays, like sha256sum",
        description="Prints, per file and labelled, vLLM's keys (MultiModalHasher.hash_kwargs(ALG, "
        "model_id=MODEL, <modality>=item)): for an image, [server] the key vLLM's server assigns "
        "when the file arrives in a request (its bytes; needs vLLM installed) and [pixels] the key "
        "of the decoded image in multi_modal_data; for a .npy array, [array]. FILE - reads stdin.",
    )
    key.add_argument("--model", required=True, help="the model string exactly as the engine was given it")
    key.add_argument("--algorithm", default="blake3", choices=ALGORITHMS)
    key.add_argument("--modality", choices=_MODALITIES, help="default: from the file")
    key.add_argument("files", nargs="+", metavar="FILE")
    key.set_defaults(run=_key)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``omni-requests`` command."""
    args = _parser().parse_args(argv)
    try:
        status: int = args.run(args)
    except OmniRequestsError as error:
        print(f"omni-requests: {error}", file=sys.stderr)
        return 2
    return status


if __name__ == "__main__":
    sys.exit(main())
