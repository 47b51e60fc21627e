"""A PIL image's EXIF as vLLM's parser reads it, read without changing the image.

Pillow parses an image's EXIF on its first ``getexif()`` and keeps the result on the
image (``_exif``). That cache is state: once filled, ``getexif()`` never reads
``image.info`` again, so a caller who later sets ``info["exif"]`` would have vLLM read
the old tags. Tags set or deleted through ``getexif()`` live only in the cache, not in
``info``, and ``Image.copy()`` drops them.

vLLM's image parser reads two tags: the orientation (it turns the image upright) and the
ImageID (its hasher keys an image by a UUID there). Edits to those are what a record must
carry; other tags reach no key and no pixel, and are dropped as ``Image.copy()`` drops them.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Final

from ._errors import NOT_THE_INPUTS, Fault, read_or_fault

__all__: list[str] = []

# EXIF tag 0x800D, "ImageID" (PIL.ExifTags.Base.ImageID): vLLM keys an image by this UUID when set.
EXIF_IMAGE_ID: Final = 0x800D
# EXIF tag 0x0112, "Orientation": vLLM's parser turns the image upright by it.
EXIF_ORIENTATION: Final = 0x0112
# The tags vLLM's image parser reads.
PARSER_TAGS: Final = (EXIF_ORIENTATION, EXIF_IMAGE_ID)

# What an edit that deleted a tag records.
DELETED: Final = None

ExifEdits = dict[int, Any]
"""Parser tags as ``getexif()`` gives them where ``info`` says otherwise: tag -> value, or
:data:`DELETED`."""


# Held while a caller's image's EXIF is read. Pillow's getexif() fills its cache on the
# image itself, marked read before it is parsed, and exif_untouched empties it again:
# threads reading one image at once saw each other's half-read cache, and an image was
# keyed (and sealed) without its orientation (found by a review, helper-88).
_READING: Final = threading.RLock()


@contextlib.contextmanager
def exif_untouched(image: Any) -> Iterator[Callable[[], None]]:
    """Inside, ``image.getexif()`` may be called; after, Pillow's cache is as it was.

    A caller's image is not ours to change: an empty cache is emptied again. Not a TIFF's:
    its EXIF is read from the file, which loading it (as hashing does) closes, after
    turning the image upright by the cache it fills; that cache cannot be read again.
    One thread at a time reads inside. Gives a function that empties the cache where it
    was empty, so that a read that failed halfway can be made again from the start.
    """
    with _READING:
        empty = getattr(image, "_exif", None) is None and not hasattr(image, "tag_v2")

        def forget() -> None:
            if empty:
                image._exif = None

        try:
            yield forget
        finally:
            forget()


def parser_tags(image: Any) -> dict[int, Any]:
    """The parser's tags that ``image.getexif()`` holds, the image left as it was.

    Raises what ``getexif()`` raises (malformed EXIF).
    """
    with exif_untouched(image):
        return _tags(image.getexif())


def readable_tags(image: Any) -> dict[int, Any] | Fault:
    """:func:`parser_tags`, or a :class:`Fault` where ``image``'s EXIF cannot be parsed
    (what is not the image's fault is raised: see ``confirm_fault``)."""
    with exif_untouched(image) as forget:
        return read_or_fault(lambda: _tags(image.getexif()), forget)


def _tags(exif: Any) -> dict[int, Any]:
    return {tag: exif[tag] for tag in PARSER_TAGS if tag in exif}


def exif_edits(image: Any) -> ExifEdits | None:
    """The parser's tags that ``image.getexif()`` gives otherwise than ``image.info`` holds
    (set or deleted through ``getexif()``), or None when they agree.

    Cheap where nothing was parsed yet (no cache: ``getexif()`` will read ``info``). None
    for a TIFF, whose tags come from its file, not ``info``, and for malformed EXIF: the
    copy a record makes is then compared with the image instead (see ``seal_image``).
    """
    if getattr(image, "_exif", None) is None or hasattr(image, "tag_v2"):
        return None
    from PIL import Image  # an image exists, so Pillow is imported already

    cached = readable_tags(image)
    probe = Image.Image()  # no pixels: only its info is read
    probe.info = image.info
    parsed = readable_tags(probe)
    if isinstance(cached, Fault) or isinstance(parsed, Fault):
        return None  # malformed EXIF: vLLM tolerates it, and so do the callers
    edits = {
        tag: _own(cached.get(tag, DELETED))
        for tag in PARSER_TAGS
        if (tag in cached) != (tag in parsed) or not same_value(cached.get(tag), parsed.get(tag))
    }
    return edits or None


def pickled_tags(image: Any) -> dict[int, Any] | None:
    """The parser's tags a pickle of ``image`` must carry, or None where the unpickled image
    reads them from ``info`` as this one does (Pillow's pickle keeps ``info``, not the
    EXIF cache). A TIFF's tags come from its file; tags set or deleted through
    ``getexif()`` live in the cache; a cache over an ``info["exif"]`` that cannot be
    parsed gives tags the unpickled image could not read."""
    if getattr(image, "_exif", None) is None and not hasattr(image, "tag_v2"):
        return None
    tags = readable_tags(image)
    if isinstance(tags, Fault):
        return None  # malformed: vLLM reads no tags, nor will the unpickled image
    if hasattr(image, "tag_v2"):
        return tags
    from PIL import Image  # an image exists, so Pillow is imported already

    probe = Image.Image()  # no pixels: only its info is read
    probe.info = image.info
    parsed = readable_tags(probe)
    if isinstance(parsed, Fault):
        return tags  # info cannot be parsed, the cache could
    same = tags.keys() == parsed.keys() and all(same_value(tags[tag], parsed[tag]) for tag in tags)
    return None if same else {tag: _own(value) for tag, value in tags.items()}


def restore_parser_tags(image: Any, tags: dict[int, Any]) -> None:
    """Makes ``image.getexif()`` (an unpickled image of ours) give exactly ``tags`` among
    the parser's tags, even where its ``info["exif"]`` cannot be parsed."""
    try:
        exif = image.getexif()
    except NOT_THE_INPUTS:  # a timeout or no memory: never taken for the input's
        raise
    except Exception:  # noqa: BLE001 - info Pillow cannot parse (EXIF, its raw profile, XMP)
        image._exif = None  # the failed parse left a partial cache behind
        saved, image.info = image.info, {}
        try:
            exif = image.getexif()  # an empty cache, read from nothing
        finally:
            image.info = saved
    for tag in PARSER_TAGS:
        exif.pop(tag, None)
        if tag in tags:
            exif[tag] = _own(tags[tag])


def same_value(a: object, b: object) -> bool:
    """``a == b`` for tag values, where an ``==`` that raises or is not a bool means no."""
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except NOT_THE_INPUTS:  # a timeout or no memory: never taken for the input's
        raise
    except Exception:  # noqa: BLE001 - a value whose == raises was put there
        return False


def _own(value: Any) -> Any:
    """A copy of a tag value (an ImageID may be a list or a dict, which its holder could
    change in place), or the value itself where it cannot be copied."""
    if value is None or isinstance(value, (int, float, str, bytes, uuid.UUID)):
        return value
    try:
        return copy.deepcopy(value)
    except NOT_THE_INPUTS:  # a timeout or no memory: never taken for the input's
        raise
    except Exception:  # noqa: BLE001 - an object deepcopy refuses: shared, as Pillow would
        return value


def apply_exif_edits(image: Any, edits: ExifEdits) -> None:
    """Sets ``edits`` in ``image.getexif()`` (deletes the :data:`DELETED` ones): on an
    image of ours, whose cache then holds them."""
    exif = image.getexif()
    for tag, value in edits.items():
        if value is DELETED:
            exif.pop(tag, None)
        else:
            exif[tag] = _own(value)


def copy_with_exif(image: Any) -> Any:
    """A plain copy of ``image`` (``Image.Image.copy``) that keeps the parser's tags edited
    through ``getexif()``, which Pillow's own copy drops."""
    from PIL import Image  # an image exists, so Pillow is imported already

    copied = Image.Image.copy(image)
    edits = exif_edits(image)
    if edits:
        apply_exif_edits(copied, edits)
    return copied
