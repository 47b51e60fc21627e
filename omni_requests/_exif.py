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

import copy
import os
import threading
import uuid
from typing import Any, Final

from ._errors import NOT_THE_INPUTS, Fault, read_or_fault
from ._identity import IdentityMap

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


def exif_of(image: Any) -> Any:
    """What ``image.getexif()`` gives, read without changing ``image``: raises what it raises.

    Pillow's ``getexif()`` fills its cache on the image itself, marked read before it is
    parsed: threads reading one caller's image at once saw each other's half-read cache,
    and emptying it again afterwards raced with them (an image was keyed and sealed
    without its orientation; found by a review, helper-88). So a cache already read
    (its holder's, or the one a TIFF's loading fills) is read as it is, never written;
    otherwise the EXIF is parsed on a stand-in of ours over the image's ``info``. A
    ``getexif`` of the image's own is called as vLLM calls it: one set on the image as it
    is, a subclass's on the image under its lock, its cache emptied again where it was
    empty. A TIFF reads its file, under the image's lock too (its loads take it).
    """
    bound = image.getexif
    getexif: Any = getattr(bound, "__func__", None)
    pillows = _pillows_getexif()
    if not _bound_to(bound, image):  # one set on the image (another's, say): called as it is
        return bound()
    tiff = _is_tiff(image)
    if tiff or getexif not in pillows:  # the image's file, or a subclass's code: on the image
        with _lock_of(image):
            empty = getattr(image, "_exif", None) is None and not tiff
            try:
                return bound()
            finally:
                if empty:
                    image._exif = None
    cached = getattr(image, "_exif", None)
    if cached is not None and cached._loaded:
        return cached
    if getexif is not pillows[0] and "exif" not in image.info:  # a PNG's may follow its pixels
        load_image(image)
    probe = _over_info(image)
    if cached is not None:  # an Exif not marked read: Pillow parses info over its tags
        probe._exif = _unread_copy(cached)
    return probe.getexif()


def _unread_copy(exif: Any) -> Any:
    """A copy of an ``Exif`` not marked read that Pillow may parse over without changing
    ``exif``: its containers copied (Pillow clears them in place), not its values, which
    ``deepcopy`` could refuse (a ``memoryview``; helper-92)."""
    fresh = copy.copy(exif)
    for name in ("_data", "_hidden_data", "_ifds"):
        if isinstance(getattr(exif, name, None), dict):
            setattr(fresh, name, dict(getattr(exif, name)))
    return fresh


def _is_tiff(image: Any) -> bool:
    """Whether ``image`` is a TIFF file's, whose EXIF Pillow reads from the file (by class:
    a ``__getattr__`` can answer ``tag_v2`` for anything; helper-92)."""
    from PIL import TiffImagePlugin  # an image exists, so Pillow is imported already

    return isinstance(image, TiffImagePlugin.TiffImageFile)


def _bound_to(method: Any, image: Any) -> bool:
    return getattr(method, "__self__", None) is image


def exif_view(image: Any) -> Any:
    """A plain image over ``image``'s pixels (no copy) whose ``getexif()`` gives what
    ``image``'s does: what Pillow's ``exif_transpose`` may read instead of the caller's
    image, which it would fill the EXIF cache of. Raises what :func:`exif_of` raises."""
    load_image(image)
    return reading(image._new(image.im), exif_of(image))


def reading(image: Any, exif: Any) -> Any:
    """``image`` (ours), its ``getexif()`` giving ``exif`` as it is, as the image that
    gave it did: Pillow's own would parse ``info`` over an ``Exif`` not marked read."""
    image.getexif = lambda: exif
    return image


def load_image(image: Any) -> None:
    """``image.load()``, a file image's one thread at a time: Pillow's load is not
    thread-safe, and threads keying one lazily opened image got wrong keys and Pillow's
    errors (found by a review, helper-91)."""
    if not hasattr(image, "tile"):  # no file behind it: nothing to decode
        image.load()
        return
    with _lock_of(image):
        image.load()


def _lock_of(image: Any) -> Any:
    """The lock of ``image``'s own that its loads and EXIF reads through its own code
    take. Its own: an image whose stream stalls holds up no other (64 shared ones did;
    helper-92). Reentrant: a subclass's ``load`` may read the image again."""
    lock = _IMAGE_LOCKS.locks.get(image)
    if lock is None:
        with _IMAGE_LOCKS.made:
            lock = _IMAGE_LOCKS.locks.get(image)
            if lock is None:
                lock = threading.RLock()
                _IMAGE_LOCKS.locks.put(image, lock)
    return lock


class _ImageLocks:
    """Each image's lock, leaving with its image; a process forked while another thread
    held one starts with none held."""

    def __init__(self) -> None:
        self._forget()
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self.made = threading.Lock()
        self.locks: IdentityMap[Any] = IdentityMap()


_IMAGE_LOCKS: Final = _ImageLocks()


def _pillows_getexif() -> tuple[Any, ...]:
    """Pillow's own ``getexif`` methods, the plain one first: a PNG's loads the image
    where its EXIF may follow the pixels, then reads as the plain one does."""
    from PIL import Image, PngImagePlugin  # an image exists, so Pillow is imported already

    return (Image.Image.getexif, PngImagePlugin.PngImageFile.getexif)


def _over_info(image: Any) -> Any:
    """A stand-in whose ``getexif()`` parses ``image.info`` (read, never written)."""
    from PIL import Image  # an image exists, so Pillow is imported already

    probe = Image.Image()  # no pixels: only its info is read
    probe.info = image.info
    return probe


def parser_tags(image: Any) -> dict[int, Any]:
    """The parser's tags that ``image.getexif()`` holds, the image left as it was.

    Raises what ``getexif()`` raises (malformed EXIF).
    """
    return _tags(exif_of(image))


def readable_tags(image: Any) -> dict[int, Any] | Fault:
    """:func:`parser_tags`, or a :class:`Fault` where ``image``'s EXIF cannot be parsed
    (what is not the image's fault is raised: see ``confirm_fault``)."""
    return read_or_fault(lambda: parser_tags(image))


def _tags(exif: Any) -> dict[int, Any]:
    return {tag: exif[tag] for tag in PARSER_TAGS if tag in exif}


def exif_edits(image: Any) -> ExifEdits | None:
    """The parser's tags that ``image.getexif()`` gives otherwise than ``image.info`` holds
    (set or deleted through ``getexif()``), or None when they agree.

    Cheap where nothing was parsed yet (no cache: ``getexif()`` will read ``info``). None
    for a TIFF, whose tags come from its file, not ``info``, and for malformed EXIF: the
    copy a record makes is then compared with the image instead (see ``seal_image``).
    """
    if getattr(image, "_exif", None) is None or _is_tiff(image):
        return None
    cached = readable_tags(image)
    parsed = readable_tags(_over_info(image))
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
    if getattr(image, "_exif", None) is None and not _is_tiff(image):
        return None
    tags = readable_tags(image)
    if isinstance(tags, Fault):
        return None  # malformed: vLLM reads no tags, nor will the unpickled image
    if _is_tiff(image):
        return tags
    parsed = readable_tags(_over_info(image))
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
