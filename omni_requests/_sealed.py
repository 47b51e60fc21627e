"""Sealed media: the pixels of a record's images and tensors, which no one can change.

An array can be made immutable (read-only, backed by ``bytes``; numpy refuses to make it
writable again), so its key is computed once. A PIL image or a tensor cannot: Pillow's
read-only flag can be reset and ``Image.frombytes`` writes behind it, and torch's version
counter misses writes through ``.numpy()`` or ``.data``. So a record does not keep the
caller's image or tensor. It copies the bytes once, at construction, into a store that
nothing outside this module can reach, and works from the store only:

* keys and fingerprints are computed from the store and cached by the store's identity;
* every hand-out to an engine (``to_vllm``, pickling, the wire format) is a fresh image or
  tensor over the store, which its receiver may change at will.

The record's own item (what ``record.multi_modal_data`` shows) is such a hand-out too,
registered here as the store's view. Changing it changes that object only: the record
keys and sends what it sealed.

Large stores live in a sealed ``memfd`` (Linux): the kernel refuses every write to it,
and each hand-out is a private copy-on-write mapping of it, made in microseconds whatever
the size, sharing memory until someone writes. Elsewhere, for small items, or once the
process nears its open-file limit, the store is a private ``bytes`` object and each hand-out
a copy of it.

Only record code reads a view as its seal (``current``): anyone else
given a record's view, a hasher's public calls included, reads the object as it is now.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import copy
import copyreg
import ctypes
import mmap
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Final, TypeVar

from ._errors import NOT_THE_INPUTS, Fault
from ._exif import (
    ExifEdits,
    apply_exif_edits,
    copy_with_exif,
    exif_edits,
    load_image,
    readable_tags,
    same_value,
)
from ._identity import IdentityMap

__all__: list[str] = []

# An image is written to its store in bands of about this many bytes.
_BAND_BYTES: Final = 8 << 20
# From this many bytes a store is a sealed memfd (when the system has them): below it a
# copy costs less than the mapping's system calls.
_MAPPED_FROM: Final = 1 << 20
# Open files the mapped stores may hold (one each; a hand-out's mapping holds none), as a
# share of the process's limit; past it, stores are bytes objects.
_FD_SHARE: Final = 4
# The Pillow modes sealed, with the raw layout a store holds: Pillow keeps RGB as four
# bytes a pixel, so an RGB store holds RGBX rows (see _layout).
_IMAGE_LAYOUTS: Final = {"RGB": "RGBX", "RGBA": "RGBA", "L": "L"}
# The store's system calls go through libc, not Python's os and mmap modules:
# - before Python 3.13 mmap.mmap keeps a duplicate of the file open for each mapping,
#   and a template sent a thousand times would hold a thousand open files;
# - os and mmap let go of the GIL for each call, and beside a thread busy in Python each
#   costs up to a switch interval (5 ms) to get it back; these calls take microseconds,
#   so PyDLL holds the GIL through them (only os.pwrite, which copies megabytes, lets go).
_LIBC_CALLS: Final = (
    ("memfd_create", ctypes.c_int, [ctypes.c_char_p, ctypes.c_uint]),
    ("ftruncate", ctypes.c_int, [ctypes.c_int, ctypes.c_long]),
    ("fcntl", ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_int]),
    ("open", ctypes.c_int, [ctypes.c_char_p, ctypes.c_int]),
    ("pread", ctypes.c_ssize_t, [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long]),
    ("close", ctypes.c_int, [ctypes.c_int]),
    ("mmap", ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, *[ctypes.c_int] * 3, ctypes.c_long]),
    ("munmap", ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t]),
    ("mprotect", ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]),
    ("memcpy", ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]),
    ("memset", ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]),
)


def _libc() -> Any:
    """libc with the stores' calls declared, or None where one is missing (glibc before
    2.27 has no memfd_create): then every store is a bytes object."""
    if sys.platform != "linux":
        return None
    try:
        libc = ctypes.PyDLL(None, use_errno=True)
        for name, result, arguments in _LIBC_CALLS:
            call = getattr(libc, name)
            call.restype, call.argtypes = result, arguments
    except (AttributeError, OSError):
        return None
    return libc


_LIBC: Final = _libc()
if _LIBC is not None:
    import fcntl

# Once added, no write, resize or new seal is ever allowed again, by anyone.
_SEAL_ALL: Final = (
    0 if _LIBC is None else fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
)
_MAP_FAILED: Final = ctypes.c_void_p(-1).value


def _sys(result: int) -> int:
    """``result`` of a libc call, or the OSError its errno names."""
    if result == -1:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    return result


_READ_WRITE: Final = mmap.PROT_READ | mmap.PROT_WRITE


_T = TypeVar("_T")

# False while building records that never leave the call building them (see unsealed).
_SEALING: Final = contextvars.ContextVar("omni_requests sealing", default=True)
# While unsealed: what records built in the block made of each caller object, by its id
# (the object is held too, so its id is not reused while the block runs).
_ONE_CALL: Final[contextvars.ContextVar[dict[object, tuple[object, Any]] | None]] = contextvars.ContextVar(
    "omni_requests one call", default=None
)


def unsealed() -> _Unsealed:
    """Records built inside keep the caller's images and tensors, unsealed, and share
    what they make of one caller object.

    For an adapter's records that live only within one call, rendered there and dropped
    (``scope_stage0`` of a dict): sealing would copy each item for nothing. Such a
    record hashes its images and tensors at every render, as a dict's are hashed. A
    caller's array or tensor given in two dicts of the call becomes one frozen item, so
    the call's ``one_request`` hashes it once, not once a dict.
    """
    return _Unsealed()


class _Unsealed:
    # A class, not a generator-based context manager: every routed request enters one.
    # Entered once, as a generator's would be: a second entry (nested, or from another
    # thread) would lose the first one's tokens, and leave the block's state set.
    __slots__ = ("_entered", "_sealing", "_shared")

    def __init__(self) -> None:
        self._entered = False

    def __enter__(self) -> None:
        if self._entered:
            raise RuntimeError("an unsealed block is entered once: call unsealed() for each block")
        self._entered = True
        self._sealing = _SEALING.set(False)
        self._shared = _ONE_CALL.set({})

    def __exit__(self, *_: object) -> None:
        _ONE_CALL.reset(self._shared)
        _SEALING.reset(self._sealing)


def made_in_this_call(key: tuple[object, ...], given: object, make: Callable[..., _T], *args: Any) -> _T:
    """``make(*args)``, or what it returned earlier in this ``unsealed`` block for ``key``
    (which names ``given`` by its id) while ``given`` is the same object; outside a block,
    ``make(*args)``."""
    made = _ONE_CALL.get()
    if made is None:
        return make(*args)
    found = made.get(key)
    if found is not None and found[0] is given:
        result: _T = found[1]
        return result
    result = make(*args)
    made[key] = (given, result)
    return result


def _open_files_share() -> int:
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return (soft if soft != resource.RLIM_INFINITY else 1 << 16) // _FD_SHARE
    except (ImportError, OSError, ValueError):
        return 0


class _Budget:
    """What the stores hold now (open files, protected ranges) against their share of
    the process's limit."""

    def __init__(self, limit: int) -> None:
        self._lock = threading.Lock()
        self.open = 0
        self.limit = limit

    def take(self) -> bool:
        with self._lock:
            if self.open >= self.limit:
                return False
            self.open += 1
            return True

    def give_back(self) -> None:
        with self._lock:
            self.open -= 1

    def recount(self, held: int) -> None:
        """Sets what is held now, counted afresh by the caller."""
        with self._lock:
            self.open = held


_BUDGET: Final = _Budget(_open_files_share())


# ``fill(write)`` writes an item's bytes in order, a buffer at a time, through ``write``.
Fill = Callable[[Callable[[Any], None]], None]


def _fill_all(nbytes: int, fill: Fill, put: Callable[[memoryview, int], int]) -> None:
    """Runs ``fill``, each chunk written by ``put(view, offset)`` (which returns how many
    bytes it wrote), and checks that exactly ``nbytes`` came."""
    offset = 0

    def write(chunk: Any) -> None:
        nonlocal offset
        view = memoryview(chunk).cast("B")
        while view:
            done = put(view, offset)
            offset += done
            view = view[done:]

    fill(write)
    if offset != nbytes:
        raise RuntimeError(f"a sealed store of {nbytes} bytes was given {offset}")


# A store's file holds a random tag after the item's bytes, checked before each use: a
# descriptor is only a number, and code that closes descriptors it does not own (a
# daemonizing helper, os.closerange) lets the next file opened take the store's number.
_TAG_BYTES: Final = 16


def _mapped_store(nbytes: int, fill: Fill, tag: bytes) -> int | None:
    """A sealed memfd of ``nbytes`` that ``fill`` wrote, then ``tag``; or None where the
    system has none to spare."""
    if not _SEAL_ALL or nbytes < _MAPPED_FROM or not _BUDGET.take():
        return None
    try:
        fd = _sys(_LIBC.memfd_create(b"omni-requests sealed media", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING))
    except OSError:
        _BUDGET.give_back()
        return None
    try:
        _sys(_LIBC.ftruncate(fd, nbytes + _TAG_BYTES))
        # Written, not mapped and filled: the kernel fills whole new pages as it copies,
        # where a mapping would have it zero each one first (half the cost, measured).
        _fill_all(nbytes, fill, lambda view, offset: os.pwrite(fd, view, offset))
        if os.pwrite(fd, tag, nbytes) != _TAG_BYTES:
            raise OSError("short write of a sealed store's tag")
        _sys(_LIBC.fcntl(fd, fcntl.F_ADD_SEALS, _SEAL_ALL))
    except OSError:  # a file-size limit (RLIMIT_FSIZE: EFBIG), no room for the pages, ...
        _LIBC.close(fd)
        _BUDGET.give_back()
        return None  # the store is a bytes object instead
    except BaseException:
        _LIBC.close(fd)
        _BUDGET.give_back()
        raise
    return fd


def _holds(fd: int, nbytes: int, tag: bytes) -> bool:
    """Whether descriptor ``fd`` is still the sealed store of ``nbytes`` tagged ``tag``."""
    if _LIBC.fcntl(fd, fcntl.F_GET_SEALS, 0) != _SEAL_ALL:  # -1 for a closed fd or another file
        return False
    found = ctypes.create_string_buffer(_TAG_BYTES)
    return bool(_LIBC.pread(fd, found, _TAG_BYTES, nbytes) == _TAG_BYTES and found.raw == tag)


def _close(fd: int, nbytes: int, tag: bytes) -> None:
    if _holds(fd, nbytes, tag):  # never another file that took the number
        _LIBC.close(fd)
    _BUDGET.give_back()


class Seal:
    """One item's sealed bytes and how to hand them out as the image or tensor they were."""

    __slots__ = ("__weakref__", "_bytes", "_fd", "_make", "_tag", "nbytes")

    def __init__(self, nbytes: int, fill: Fill, make: Callable[[Any, Seal], Any]) -> None:
        """``fill`` writes the item's ``nbytes``, once (see ``Fill``); ``make(buffer, seal)``
        is a new image or tensor over a writable buffer holding them."""
        self.nbytes = nbytes
        self._make = make
        self._tag = os.urandom(_TAG_BYTES)
        fd = _mapped_store(nbytes, fill, self._tag)
        self._fd = fd
        self._bytes: bytes | None = None
        if fd is None:
            stored = bytearray(nbytes)

            def put(view: memoryview, offset: int) -> int:
                stored[offset : offset + len(view)] = view
                return len(view)

            _fill_all(nbytes, fill, put)
            # bytes: a bytearray reached through a hand-out's private attributes could be
            # written; bytes only by a raw pointer or numpy's __setstate__ called on it.
            self._bytes = bytes(stored)
        else:
            weakref.finalize(self, _close, fd, nbytes, self._tag)

    def handout(self) -> Any:
        """A new image or tensor holding the sealed bytes; its holder may change it freely."""
        fd = self._fd
        if fd is None:
            return self._make(bytearray(self._bytes), self)  # type: ignore[arg-type]
        if not _holds(fd, self.nbytes, self._tag):
            raise RuntimeError(
                f"a record's sealed media store (file descriptor {fd}) was closed by code that does "
                "not own it (os.closerange, a daemonizing helper?); the record cannot send its media"
            )
        return self._make(_private_mapping(fd, self.nbytes), self)

    def untouched(self, buffer: Any) -> bool:
        """True when no byte of a hand-out's ``buffer`` was written since it was made."""
        if self._fd is None:
            return bool(buffer == self._bytes)  # at most _MAPPED_FROM bytes
        if isinstance(buffer, bytearray):  # a mapped store's copy (no mapping was left): not checked
            return False
        return _no_private_pages(ctypes.addressof(buffer), self.nbytes)


def _private_mapping(fd: int, nbytes: int) -> Any:
    """A private, writable mapping of a sealed memfd, unmapped when its last user lets go;
    a copy of its bytes where the process has no mapping to spare."""
    # Private: writes land in pages of this mapping alone, copied from the memfd's.
    address = _LIBC.mmap(None, nbytes, _READ_WRITE, mmap.MAP_PRIVATE, fd, 0)
    if address is None or address == _MAP_FAILED:
        copied = bytearray(nbytes)
        view = memoryview(copied)
        done = 0
        while done < nbytes:
            done += os.preadv(fd, [view[done:]], done)
        return copied
    mapping = (ctypes.c_char * nbytes).from_address(address)
    weakref.finalize(mapping, _LIBC.munmap, address, nbytes)
    return mapping


_PAGE: Final = mmap.PAGESIZE
# /proc/self/pagemap flags of a page: in memory, swapped out, a page of the file (or shared).
_PRESENT: Final = 1 << 63
_SWAPPED: Final = 1 << 62
_FILE_PAGE: Final = 1 << 61


def _no_private_pages(address: int, nbytes: int) -> bool:
    """True when every page of a private mapping of a sealed memfd is still the memfd's.

    The first write to a page of a private mapping gives the mapping its own copy of that
    page, an anonymous one: the kernel's page map tells it from the memfd's page, whoever
    wrote (Pillow, torch, numpy or a raw pointer). A page never read is not in memory
    yet; it is the memfd's too. Where the page map cannot be read, nothing is untouched.
    (Replacing the mapping itself with system calls is not seen: docs/security.md.)
    """
    import numpy as np

    pages = -(-nbytes // _PAGE)
    entries = np.empty(pages, dtype=np.uint64)
    fd = _LIBC.open(b"/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    if fd == -1:
        return False
    try:
        read = _LIBC.pread(fd, entries.ctypes.data, entries.nbytes, address // _PAGE * 8)
    finally:
        _LIBC.close(fd)
    if read != entries.nbytes:
        return False
    private = ((entries & _PRESENT) != 0) & ((entries & _FILE_PAGE) == 0)
    return not (private.any() or ((entries & _SWAPPED) != 0).any())


# Each record's view of a seal, by the view's identity. Only this module registers views,
# so an image or tensor found here is one a record made; an entry leaves with its view.
_VIEWS: Final[IdentityMap[Seal]] = IdentityMap()


def seal_of(value: object) -> Seal | None:
    """The seal ``value`` is a record's view of, or None."""
    return _VIEWS.get(value)


def current(value: object) -> object:
    """What the record holds for ``value``: a fresh hand-out of its seal, or ``value`` itself."""
    seal = _VIEWS.get(value)
    return value if seal is None else seal.handout()


def _register(seal: Seal) -> Any:
    """A new hand-out of ``seal``, registered as a record's view of it."""
    view = seal.handout()
    _VIEWS.put(view, seal)
    return view


def _as_given(value: Any) -> Any:
    """``value`` for a record that keeps it unsealed: itself, unless it is a record's view
    changed since (a record reads a view as its seal): then a plain copy of it as it is."""
    if _VIEWS.get(value) is None:
        return value
    if hasattr(value, "pristine"):  # an image
        return value if value.pristine() else copy_with_exif(value)
    return value.clone()  # a tensor: its writes cannot be told, so it is copied


# -- images --


_SEALED_IMAGE: list[type[Any]] = []


def is_sealed_image(value: object) -> bool:
    """Whether ``value`` is a record's hand-out of a sealed image (which pickles itself)."""
    return bool(_SEALED_IMAGE) and isinstance(value, _SEALED_IMAGE[0])


# The instance attributes of hand-outs as made, "_exif" set by getexif(), and ours.
_HANDOUT_ATTRIBUTES: set[str] = {"_exif", "_sealed"}


def _sealed_image_type() -> type[Any]:
    """``SealedImage``, made once Pillow is imported (it subclasses ``PIL.Image.Image``)."""
    if _SEALED_IMAGE:
        return _SEALED_IMAGE[0]
    from PIL import Image  # an image exists, so Pillow is imported already

    class SealedImage(Image.Image):
        """A PIL image over a record's sealed pixels: what records show and hand out.

        It is a plain PIL image to everyone (``isinstance(x, PIL.Image.Image)``), and its
        holder may change it. Until someone does, :meth:`copy` is another hand-out of the
        same pixels (a mapping, not a copy of the pixels; vLLM's image parser copies every
        image it is given), and a record given it takes the same seal (and cached key).
        It pickles as a plain image (through omni-requests where its orientation or
        ImageID was set through ``getexif()``, which Pillow's pickle drops).
        """

        _sealed: tuple[Seal, Any, Any, dict[Any, Any] | None, str, tuple[int, int], ExifEdits | None, Any]

        def pristine(self) -> bool:
            """True while this image holds exactly what it was handed out with."""
            seal, core, buffer, info, mode, size, edits, tags = self._sealed
            if buffer is None:  # its pixels were copied out of the buffer: writes are not seen
                return False
            if (
                self._im is not core
                or getattr(core, "mode", None) != mode
                or self._mode != mode
                or self._size != size
            ):
                return False  # a new core, or a palette put on this one (its mode becomes "P")
            if self.palette is not None:
                return False
            if (edits or getattr(self, "_exif", None) is not None) and not _same_tags(_tags_of(self), tags):
                return False  # the orientation or ImageID set or deleted through getexif()
            if vars(self).keys() - _HANDOUT_ATTRIBUTES:
                return False  # a method (getexif, say) or attribute put on this image itself
            held = info or {}
            try:
                same_info = bool(self.info == held) and _same_types(self.info, held)
            except NOT_THE_INPUTS:  # a timeout or no memory: never taken for the input's
                raise
            except Exception:  # noqa: BLE001 - an entry whose == raises (an array, say) was put there
                return False
            return same_info and seal.untouched(buffer)

        def __eq__(self, other: object) -> bool:
            # Pillow's own test, its exact-class check reading a hand-out as a plain image:
            # a hand-out equals a plain image (or hand-out) of the same pixels; like Pillow's
            # own copy(), it does not equal a file's image (a PngImageFile, say).
            if type(other) is not Image.Image and not isinstance(other, SealedImage):
                return False
            return (
                self.mode == other.mode
                and self.size == other.size
                and self.info == other.info
                and self.getpalette() == other.getpalette()
                and self.tobytes() == other.tobytes()
            )

        __hash__ = None  # type: ignore[assignment]  # as Pillow's images: mutable, unhashable

        def copy(self) -> Image.Image:
            if self.pristine():
                handout: Image.Image = self._sealed[0].handout()
                if self._sealed[6]:  # as Pillow's own copy, without tags set through getexif()
                    handout._exif = None
                return handout
            return Image.Image.copy(self)

        __copy__ = copy

        def __reduce_ex__(self, protocol: Any) -> Any:
            # A plain image's own pickle (Pillow's __getstate__), unpickled with Pillow alone;
            # with the orientation or ImageID set through getexif(), which Pillow's drops.
            state = Image.Image.copy(self).__getstate__()
            edits = exif_edits(self)
            if edits:
                return (_unpickled_image, (state, edits))
            return (copyreg._reconstructor, (Image.Image, object, None), state)  # type: ignore[attr-defined]

    _SEALED_IMAGE.append(SealedImage)
    return SealedImage


def _unpickled_image(state: Any, edits: ExifEdits) -> Any:
    """A pickled hand-out: a plain image, with the parser's tags set through getexif()."""
    from PIL import Image

    image = copyreg._reconstructor(Image.Image, object, None)  # type: ignore[attr-defined]
    image.__setstate__(state)
    apply_exif_edits(image, edits)
    return image


# What _tags_of reads where the EXIF cannot be parsed (vLLM reads no tags there either).
_MALFORMED: Final = object()


def _tags_of(image: Any) -> Any:
    """The parser's tags of ``image``, or ``_MALFORMED``."""
    tags = readable_tags(image)
    return _MALFORMED if isinstance(tags, Fault) else tags  # malformed EXIF: vLLM tolerates it too


def _same_types(info: dict[Any, Any], held: dict[Any, Any]) -> bool:
    """Whether equal ``info`` and ``held`` hold values of the same types: vLLM's parser
    reads a transparency of 5.0, (5.0, 0, 0) or an int subclass otherwise than 5."""
    if any(type(value) is not type(held[name]) for name, value in info.items()):
        return False
    return "transparency" not in info or repr(info["transparency"]) == repr(held["transparency"])


def _same_tags(a: Any, b: Any) -> bool:
    if a is _MALFORMED or b is _MALFORMED:
        return a is b
    return bool(a.keys() == b.keys() and all(same_value(a[tag], b[tag]) for tag in a))


def _layout(mode: str) -> str:
    """The raw layout a store of a ``mode`` image holds: Pillow's own, where it can be
    handed out without a copy (RGB as RGBX rows needs ``Image.fromarrow``, see below)."""
    return _IMAGE_LAYOUTS[mode] if mode != "RGB" or _rgb_over_rgbx() else "RGB"


def _rgb_over_rgbx() -> bool:
    """Whether Pillow can show RGBX rows as an RGB image without a copy.

    ``Image.fromarrow`` (Pillow 11.2) does it, reading the rows through the Arrow export
    of an image over the store's buffer. Before Pillow 13 that export reads a borrowed
    image's memory through a null pointer and the process dies (python-pillow/Pillow
    issue 9896; seen with 12.3.0): there RGB is stored packed, and each hand-out copies.
    """
    import PIL
    from PIL import Image  # an image exists, so Pillow is imported already

    major = PIL.__version__.split(".", 1)[0]
    return hasattr(Image, "fromarrow") and major.isdigit() and int(major) >= 13


def _image_maker(
    mode: str, layout: str, size: tuple[int, int], info: dict[Any, Any] | None, edits: ExifEdits | None
) -> Callable[[Any, Seal | None], Any]:
    from PIL import Image  # an image exists, so Pillow is imported already

    sealed_image = _sealed_image_type()
    tags: list[Any] = []  # the parser's tags of a hand-out as made: read once, what pristine() compares

    def make(buffer: Any, seal: Seal | None) -> Any:
        # Over the buffer, without a copy, for every layout but packed RGB (copied).
        image = Image.frombuffer(layout, size, buffer, "raw", layout, 0, 1)
        if layout != mode:  # RGBX rows seen as RGB: Pillow's own layout, no copy
            image = Image.fromarrow(image, mode, size)
        if info is not None:
            image.info = copy.deepcopy(info)
        if edits:  # the orientation or ImageID the sealed image had through getexif()
            apply_exif_edits(image, edits)
        if seal is not None:
            if not tags:
                tags.append(_tags_of(image))
            image.__class__ = sealed_image
            _HANDOUT_ATTRIBUTES.update(vars(image))  # what Pillow puts on an image itself
            shares = layout != "RGB"  # packed RGB: Pillow copied the buffer
            image._sealed = (seal, image._im, buffer if shares else None, info, mode, size, edits, tags[0])  # type: ignore[attr-defined]
        return image

    return make


def seal_image(image: Any) -> Any:
    """A record's view of a sealed copy of ``image``, or ``image`` where it cannot be sealed.

    Sealed: RGB, RGBA and L images without a palette whose view reads the same to vLLM's
    parser (EXIF ImageID and orientation, transparency) as ``image`` does; an ImageID or
    orientation set or deleted through ``getexif()`` is sealed with the pixels and set on
    every hand-out. Other images are kept as given and hashed on every render, as before
    (a record's changed view as a copy of it). A hand-out of a seal that no one has
    changed takes the same seal: no copy, and the key already computed.
    """
    from PIL import Image  # an image exists, so Pillow is imported already

    from ._hashing import _exif_image_id, _parsed_as  # here: _hashing imports this module

    if _SEALED_IMAGE and isinstance(image, _SEALED_IMAGE[0]) and image.pristine():
        # Pristine: the seal's info and EXIF tags, which a new view of it reads the same.
        # Taken even where records keep items unsealed: it costs no copy, and its key is cached.
        return _register(image._sealed[0])
    mode = image.mode
    if mode not in _IMAGE_LAYOUTS or image.palette is not None or 0 in image.size or not _SEALING.get():
        return _as_given(image)
    try:
        info = copy.deepcopy(dict(image.info))
    except NOT_THE_INPUTS:  # a timeout or no memory: never taken for the input's
        raise
    except Exception:  # noqa: BLE001 - an info entry that cannot be copied: keep the image as given
        return _as_given(image)
    load_image(image)
    size = image.size
    layout = _layout(mode)
    pixels = image.im  # the pixels as they are now, whatever the image's holder does next
    if pixels.mode != mode:  # a palette put on the core itself: Pillow reads through it
        return _as_given(image)

    def fill(write: Callable[[Any], None]) -> None:
        if layout == "RGB":  # packed (Pillow without a safe fromarrow)
            write(image.tobytes())
            return
        # Pillow's own row copy, core to core, into a band of ours in the store's
        # layout (an RGB core pastes into RGBX as is); a few bands, each released the
        # GIL once, so few waits beside a thread busy in Python.
        width, height = size
        line = width * len(layout)
        rows = max(1, _BAND_BYTES // line)
        band_bytes = bytearray(min(rows, height) * line)
        band = Image.frombuffer(layout, (width, min(rows, height)), band_bytes, "raw", layout, 0, 1)
        for top in range(0, height, rows):
            band.im.paste(pixels, (0, -top, width, height - top))  # the image moved up, clipped
            write(memoryview(band_bytes)[: min(rows, height - top) * line])

    maker = _image_maker(mode, layout, size, info or None, exif_edits(image))
    view = _register(Seal(size[0] * size[1] * len(layout), fill, maker))
    if _exif_image_id(view) != _exif_image_id(image) or _parsed_as(view) != _parsed_as(image):
        return _as_given(image)  # what vLLM's parser reads is not all in info: keep the image as given
    return view


# -- tensors --


@contextlib.contextmanager
def torch_as_is(tensor: Any = None) -> Iterator[None]:
    """Inside, torch's calls run torch's own code, not a function or dispatch mode the
    caller entered: a digest computed through a mode that changed what they return was
    cached for the tensor's bytes, and every later request without it sent them under it
    (found by a review, helper-88); a subclass that turns both torch hooks off (a frozen
    ``nn.Parameter``, keyed at every render) was sent under the mode's key (helper-90).
    Given a ``tensor`` of another subclass, nothing changes: its hooks run as in vLLM's
    hasher (torch's default one hands results back as the subclass, whose own methods
    the hasher then calls), and the caller's modes with them; its keys are never cached."""
    torch = sys.modules["torch"]  # a tensor exists, so torch is imported already
    if tensor is not None and not _runs_torchs_own_code(type(tensor), torch):
        yield
        return
    with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
        yield


def _runs_torchs_own_code(cls: type, torch: Any) -> bool:
    """Whether torch's calls on tensors of ``cls`` run torch's code alone: a plain
    tensor's, and a subclass's that turns both hooks off, as ``nn.Parameter`` does."""
    return bool(
        cls is torch.Tensor
        or (
            cls.__torch_function__ is torch._C._disabled_torch_function_impl  # type: ignore[attr-defined]
            and cls.__torch_dispatch__ is torch._C._disabled_torch_dispatch_impl  # type: ignore[attr-defined]
        )
    )


def _tensor_maker(dtype: Any, shape: tuple[int, ...]) -> Callable[[Any, Seal | None], Any]:
    import numpy as np
    import torch  # a tensor exists, so torch is imported already

    # Built by numpy where the dtype has a numpy twin: torch.frombuffer and reshape each
    # let go of the GIL, which beside a thread busy in Python can cost a switch interval.
    try:
        with torch_as_is():  # on the CPU, whatever the default device
            as_numpy = torch.empty(0, dtype=dtype, device="cpu").numpy().dtype
    except TypeError:  # bfloat16 and the like
        as_numpy = None

    def make(buffer: Any, seal: Seal | None) -> Any:
        with torch_as_is():
            if as_numpy is None:
                tensor = torch.frombuffer(buffer, dtype=dtype).reshape(shape)
            else:
                tensor = torch.from_numpy(np.frombuffer(buffer, dtype=as_numpy).reshape(shape))
        if seal is not None:
            _TENSOR_HANDOUTS.put(tensor, (seal, buffer, _tensor_layout(tensor)))
        return tensor

    return make


# Hand-outs of sealed tensors, each with its seal, its buffer and its layout as made.
# Given to a record again (or read into one for a dict), an untouched hand-out takes its
# seal, as an image's does: no copy, and the key already computed.
_TENSOR_HANDOUTS: Final[IdentityMap[tuple[Seal, Any, tuple[Any, ...]]]] = IdentityMap()


def _tensor_layout(tensor: Any) -> tuple[Any, ...]:
    """What, besides its bytes, makes a tensor read as it does; in-place ops change it
    (``set_``, ``resize_``, ``transpose_``, ``as_strided_``, conjugate and negative bits)."""
    return (
        type(tensor),
        tensor.data_ptr(),
        tuple(tensor.shape),
        tensor.stride(),
        tensor.storage_offset(),
        tensor.dtype,
        _view_bits(tensor),
        tensor.requires_grad,
    )


def _view_bits(tensor: Any) -> object:
    """The tensor's dispatch keys, conjugate and negative bits among them (both settable
    in place: ``torch._C._set_conj``). Read through ``_dispatch_keys``, which holds the
    GIL: ``is_conj()`` and ``is_neg()`` let go of it, each a possible wait of a switch
    interval beside a thread busy in Python."""
    import torch

    dispatch_keys = getattr(torch._C, "_dispatch_keys", None)
    if dispatch_keys is None:  # a torch without it: the public calls
        return (tensor.is_conj(), tensor.is_neg())
    return dispatch_keys(tensor).raw_repr()


def given_back_tensor(tensor: Any) -> Any:
    """A record's view of the seal ``tensor`` is an untouched hand-out of, or None.

    Taken even where records keep items unsealed (it costs no copy, and its key is
    cached), and before any check of the tensor: those ran when it was sealed, and
    torch's own calls may let go of the GIL.
    """
    entry = _TENSOR_HANDOUTS.get(tensor)
    if entry is None:
        return None
    seal, buffer, layout = entry
    if _tensor_layout(tensor) != layout or not seal.untouched(buffer):
        return None
    return _register(seal)


def seal_tensor(tensor: Any) -> Any:
    """A record's view of a sealed copy of ``tensor``, or ``tensor`` where it cannot be sealed
    (called under :func:`torch_as_is`).

    Sealed: plain CPU tensors with elements that need no gradient. Others (a subclass,
    another device or layout, ``requires_grad``) are kept as given and hashed on every
    render, as before.
    """
    import torch

    if (
        not _SEALING.get()
        or type(tensor) is not torch.Tensor
        or tensor.device.type != "cpu"
        or tensor.layout is not torch.strided
        or tensor.requires_grad
        or tensor.is_quantized
        or tensor.numel() == 0
    ):
        return _as_given(tensor)
    make = _tensor_maker(tensor.dtype, tuple(tensor.shape))
    source = tensor.detach()

    def fill(write: Callable[[Any], None]) -> None:
        # The bytes in row-major order, viewed as bytes whatever the dtype (bfloat16 too).
        flat = source.reshape(-1)  # a view where it can be, else a copy
        if flat.stride(0) != 1:  # one element, whose stride torch keeps as given
            flat = flat.clone(memory_format=torch.contiguous_format)
        write(flat.view(torch.uint8).numpy())

    return _register(Seal(source.numel() * source.element_size(), fill, make))


# -- arrays --

# From this many bytes a record's array lives on pages the kernel refuses to write (see
# read_only_copy); below it the two protection calls would cost several times the copy.
PROTECTED_FROM: Final = 64 << 10
# Each protected range splits a mapping of the heap in up to three (two more), and the
# kernel allows a process vm.max_map_count mappings in all: the ranges may add this share.
_MAPPINGS_SHARE: Final = 4


def _protected_ranges_share() -> int:
    if _LIBC is None:
        return 0
    try:
        with open("/proc/sys/vm/max_map_count", "rb") as limit:
            return int(limit.read()) // _MAPPINGS_SHARE // 2
    except (OSError, ValueError):
        return 0


_PROTECTED: Final = _Budget(_protected_ranges_share())
# An uninitialised bytes object, which its maker fills before anyone else sees it.
_NEW_BYTES: Final = ctypes.pythonapi.PyBytes_FromStringAndSize
_NEW_BYTES.restype, _NEW_BYTES.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_ssize_t]
_PROBE: Final = b"omni-requests"
# Where a bytes object's first byte lies, from the object's address (CPython's layout).
_BYTES_DATA: Final = (ctypes.cast(ctypes.c_char_p(_PROBE), ctypes.c_void_p).value or 0) - id(_PROBE)


class _Protection(weakref.ref):  # type: ignore[type-arg]
    """Pages of ``data`` kept read-only while the array over them lives."""

    __slots__ = ("data", "size", "start")
    data: bytes
    size: int
    start: int


# The live protections, by their own identity (a weak reference calls back only while it
# is itself alive, and hashes as its array, which cannot be hashed).
_PROTECTIONS: Final[dict[int, _Protection]] = {}
# Bytes whose pages could not be made writable again: never freed, or the allocator would
# hand read-only pages to its next caller.
_KEPT: Final[list[bytes]] = []


def _lift(protection: _Protection) -> None:
    """Makes the pages writable again, before ``data`` can go back to the allocator.

    The system call comes first: a signal handler that raises (a request timeout, Ctrl-C)
    runs between Python's steps, and one raised before it would leave the pages
    read-only under memory the allocator hands to its next caller."""
    if _LIBC.mprotect(protection.start, protection.size, _READ_WRITE) != 0:
        _KEPT.append(protection.data)
    if _PROTECTIONS.pop(id(protection), None) is not None:  # once per protection
        _PROTECTED.give_back()


# The table is swept when it reaches this many entries, then at twice what lives after each
# sweep: amortised, each entry is visited a bounded number of times.
_SWEEP_FROM: Final = 64
_sweep_at = _SWEEP_FROM


def _take_protection() -> bool:
    """A unit of the budget, after a sweep where one is due (see ``_sweep``)."""
    if len(_PROTECTIONS) >= _sweep_at:
        _sweep()
    if _PROTECTED.take():
        return True
    _sweep()
    return _PROTECTED.take()


def _sweep() -> None:
    """Lifts dead protections and recounts the budget from the live ones.

    A signal handler that raises (a request timeout) inside ``_lift``, a weak reference's
    callback, is printed and dropped by Python: the array's protection stays in the
    table, its pages read-only and its bytes held, or a unit stays counted with no
    protection behind it. Swept on a schedule, such leftovers are bounded by what lives
    (and ``_SWEEP_FROM``), not kept until the budget runs out. A unit another thread has
    taken but not yet registered is not recounted: the budget can then run over by as
    many units as threads were building at the moment, until the next sweep."""
    global _sweep_at
    for protection in list(_PROTECTIONS.values()):
        if protection() is None:
            _lift(protection)
    live = len(_PROTECTIONS)
    _PROTECTED.recount(live)
    _sweep_at = max(_SWEEP_FROM, 2 * live)


@atexit.register
def _lift_all() -> None:
    # At exit objects are freed without their weak references' callbacks.
    for protection in list(_PROTECTIONS.values()):
        _lift(protection)


def read_only_copy(source: Any) -> Any:
    """A read-only C-ordered copy of numpy array ``source`` over a ``bytes`` object whose
    pages under it the kernel refuses to write for as long as the copy or any view of it lives; None from
    arrays under ``PROTECTED_FROM`` or where the system has no protection to spare (the
    caller copies into a plain ``bytes`` object).

    numpy refuses to make the copy writable; the pages stop what ignores that flag too
    (``torch.from_numpy`` and its kin, ``ctypes``): a write through them kills the process
    with SIGSEGV instead of changing bytes whose key a record has cached.
    """
    import numpy as np

    nbytes = source.nbytes
    if _LIBC is None or nbytes < PROTECTED_FROM or not _take_protection():
        return None
    protection = None
    try:
        data = _NEW_BYTES(None, nbytes + 2 * _PAGE)  # room to start on a page and end on one
        address = id(data) + _BYTES_DATA
        start = -(-address // _PAGE) * _PAGE
        size = -(-nbytes // _PAGE) * _PAGE
        # The slack before and after is zeroed: it held whatever the allocator's last user
        # left. libc's calls, which hold the GIL, as a bytes copy does (see _LIBC_CALLS).
        _LIBC.memset(address, 0, start - address)
        _LIBC.memset(start + nbytes, 0, address + len(data) - start - nbytes)
        if source.flags.c_contiguous:
            _LIBC.memcpy(start, source.ctypes.data, nbytes)
        else:  # numpy reads it in C order, as np.ascontiguousarray would
            target = np.frombuffer((ctypes.c_ubyte * nbytes).from_address(start), source.dtype, source.size)
            np.copyto(target.reshape(source.shape), source, casting="no")
            del target
        copy = np.frombuffer(data, source.dtype, source.size, start - address).reshape(source.shape)
        # Registered before the pages are protected: from here on, whatever is raised,
        # the array's death makes them writable again and gives the budget back.
        # Tied to the array over the bytes, the base of every view of the copy: the
        # record hands out views, which may outlive the copy (and its record).
        protection = _Protection(copy.base, _lift)
        protection.data, protection.size, protection.start = data, size, start
        _PROTECTIONS[id(protection)] = protection
    except BaseException:  # a copy that failed (MemoryError) or a signal handler's raise
        if protection is not None:  # its pages were never protected
            _PROTECTIONS.pop(id(protection), None)
        _PROTECTED.give_back()
        raise
    if _LIBC.mprotect(start, size, mmap.PROT_READ) != 0:  # no mapping to spare: a plain copy
        _lift(protection)
    return copy
