"""A PIL image's EXIF as vLLM's parser reads it, read without changing the image.

Pillow parses an image's EXIF on its first ``getexif()`` and keeps the result on the
image (``_exif``). That cache is state: once filled, ``getexif()`` never reads
``image.info`` again, so a caller who later sets ``info["exif"]`` (a new EXIF ImageID,
say) would have vLLM read the old tags. Edits made through ``getexif()`` live only in the
cache, not in ``info``, and ``Image.copy()`` drops them.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

__all__: list[str] = []


@contextlib.contextmanager
def exif_untouched(image: Any) -> Iterator[None]:
    """Inside, ``image.getexif()`` may be called; after, Pillow's cache is as it was.

    A caller's image is not ours to change: an empty cache is emptied again.
    """
    empty = getattr(image, "_exif", None) is None
    try:
        yield
    finally:
        if empty:
            image._exif = None


def exif_edited(image: Any) -> bool:
    """True when ``image.getexif()`` gives other tags than ``image.info`` holds.

    That is, tags were set or deleted through ``getexif()`` (or ``info`` changed after it
    was read): ``Image.copy()`` and a seal, both built from ``info``, would drop them.
    Where it cannot be told (a TIFF file, whose EXIF is read from the file), True.
    """
    exif = getattr(image, "_exif", None)
    if exif is None:
        return False
    if hasattr(image, "tag_v2"):
        return True
    from PIL import Image  # an image exists, so Pillow is imported already

    try:
        probe = Image.Image()  # no pixels: only its info is read
        probe.info = image.info
        parsed, cached = probe.getexif(), image.getexif()
        if dict(cached) != dict(parsed):
            return True
        # Sub-directories (Exif, GPS) are parsed when first asked for, and edited there.
        return any(cached.get_ifd(tag) != parsed.get_ifd(tag) for tag in list(cached._ifds))
    except Exception:  # noqa: BLE001 - malformed EXIF, or a value whose == raises: not as info says
        return True


def copy_with_exif(image: Any) -> Any:
    """A plain copy of ``image`` (``Image.Image.copy``) that keeps tags edited through
    ``getexif()``, which Pillow's own copy drops."""
    from PIL import Image  # an image exists, so Pillow is imported already

    copied = Image.Image.copy(image)
    exif = getattr(image, "_exif", None)
    if exif is not None:
        copied._exif = copy.deepcopy(exif)
    return copied
