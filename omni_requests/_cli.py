"""The ``omni-requests`` command: the template-reuse demo, and vLLM content keys of files."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ._errors import OmniRequestsError
from ._hashing import MediaHasher

__all__ = ["main"]

_MODALITY_BY_NDIM = {1: "audio", 3: "image", 4: "video"}


def _load(path: Path, modality: str | None) -> tuple[str, Any]:
    if path.suffix == ".npy":
        array = np.load(path, allow_pickle=False)
        chosen = modality or _MODALITY_BY_NDIM.get(array.ndim)
        if chosen is None:
            raise ValueError(f"cannot tell the modality of a {array.ndim}-d array; pass --modality")
        return chosen, array
    try:
        from PIL import Image
    except ImportError:
        raise ValueError("image files need Pillow: pip install 'omni-requests[images]'") from None
    with Image.open(path) as image:
        image.load()
        return modality or "image", image.copy()


def _key(args: argparse.Namespace) -> int:
    hasher = MediaHasher(args.model, args.algorithm)
    status = 0
    for name in args.files:
        try:
            modality, item = _load(Path(name), args.modality)
            print(f"{hasher.key(modality, item)}  {name}")
        except (OSError, ValueError) as error:
            print(f"omni-requests: {name}: {error}", file=sys.stderr)
            status = 1
    return status


def _demo(_: argparse.Namespace) -> int:
    from ._demo import format_demo, run_demo

    dict_rows, record_rows = run_demo()
    print(format_demo(dict_rows, record_rows), end="")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omni-requests", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run the template-reuse scenario with dicts and with records")
    demo.set_defaults(run=_demo)
    key = commands.add_parser(
        "key",
        help="print vLLM's content key of image files and .npy arrays, like sha256sum",
        description="Prints MultiModalHasher.hash_kwargs(ALG, model_id=MODEL, <modality>=item) for each "
        "file, as vLLM computes it for that item in multi_modal_data. vLLM converts non-RGB "
        "images to RGB before hashing; see the docs for the engine's view of an item.",
    )
    key.add_argument("--model", required=True, help="the model string exactly as the engine was given it")
    key.add_argument("--algorithm", default="blake3", choices=("blake3", "sha256", "sha512"))
    key.add_argument("--modality", help="image, video or audio (default: from the file)")
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
