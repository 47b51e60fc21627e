"""Content keys computed exactly like vLLM's ``MultiModalHasher.hash_kwargs``.

The byte stream fed to the digest follows vLLM >= 0.31: every chunk is preceded by
its length (8 bytes, little endian) and every value by a tag (None, sequence, mapping,
leaf), so distinct inputs cannot produce the same stream. Where vLLM copies (a PIL
image through ``np.asarray``, a non-contiguous array through ``tobytes``) we feed the
same bytes without building the intermediate objects: an image's pixels are packed and
hashed a chunk at a time, never as one image-sized ``bytes`` (a large RGB image is
packed on the calling thread while a helper thread hashes).

:meth:`MediaHasher.fingerprint` is the cheap cousin of a key: type, shape, length and a
fixed sample of the bytes, for binding a user UUID to the item it was given for.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import queue
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from functools import cache, partial
from typing import Any, Final, Literal

import attrs
import numpy as np
from blake3 import blake3
from pyrsistent import PVector

from ._errors import InvalidPromptError, PromptTypeError, type_name
from ._media import immutable_token, is_pil_image, is_torch_tensor, never_written
from ._media_bytes import feed_media_with_bytes, is_media_with_bytes

__all__ = ["HashAlgorithm", "MediaHasher"]

HashAlgorithm = Literal["blake3", "sha256", "sha512"]
_ALGORITHMS: Final = ("blake3", "sha256", "sha512")

_TAG_NONE: Final = b"\x00"
_TAG_SEQUENCE: Final = b"\x01"
_TAG_MAPPING: Final = b"\x02"
_TAG_LEAF: Final = b"\x03"

# Above this size blake3 hashes with every core; the digest is the same either way. On 2
# idle cores that is 1.5x to 1.9x faster from 16 MB up; with the other core busy it is
# 0.9x to 1.0x (docs/benchmarks.md), a smaller loss than the gain.
_PARALLEL_BYTES: Final = 8 << 20
# Non-contiguous arrays are streamed in C order in blocks of about this size.
_BLOCK_BYTES: Final = 16 << 20
# EXIF tag 0x800D, "ImageID" (PIL.ExifTags.Base.ImageID): vLLM keys an image by this UUID when set.
_EXIF_IMAGE_ID: Final = 0x800D

# Image pixels are packed and hashed in chunks of about this size (fits in L2).
_PIXEL_CHUNK: Final = 256 << 10
# RGB images with at least this many bytes of packed pixels are packed on the calling
# thread while a helper thread hashes (see _rgb_overlapped): Pillow's 4-byte pixels
# copied per band (packed and handed over as one slot), and how many slots take turns.
_OVERLAPPED_BYTES: Final = 4 << 20
_BAND_BYTES: Final = 512 << 10
_SLOTS: Final = 3
# Hashing a chunk, or pasting and packing a band, takes well under this (tens to a few
# hundred microseconds). A step that took longer most likely waited for the GIL: another
# thread is busy in Python, and each further release of the GIL could cost a switch
# interval (5 ms), so the rest of the image is fed in one piece (see _fed, _rgb_overlapped).
_GIL_WAIT: Final = 0.002
# Image modes whose packed pixels are known to be what ``np.asarray(image)`` holds (tested).
_STREAMED_MODES: Final = frozenset(
    {
        "1", "CMYK", "F", "HSV", "I", "I;16", "I;16B", "I;16L", "I;16N", "L", "LA", "La",
        "LAB", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "YCbCr",
    }
)  # fmt: skip
# A fingerprint reads buffers up to this size whole, larger ones as evenly spaced samples.
_SAMPLES: Final = 16
_SAMPLE_BYTES: Final = 4096
_SAMPLED_ROWS: Final = 16
_FINGERPRINT_HEX: Final = 32

_Update = Callable[[Any], object]
_Leaf = Callable[[_Update, object], None]


def _length(value: int) -> bytes:
    return value.to_bytes(8, "little")


def _framed(update: _Update, chunk: bytes | memoryview) -> None:
    update(_length(chunk.nbytes if isinstance(chunk, memoryview) else len(chunk)))
    update(chunk)


def _named(update: _Update, name: str, value: object, leaf: _Leaf) -> None:
    _framed(update, name.encode("utf-8"))
    _value(update, value, leaf)


def _value(update: _Update, value: object, leaf: _Leaf | None = None) -> None:
    if value is None:
        update(_TAG_NONE)
    elif isinstance(value, (list, tuple, PVector)):
        update(_TAG_SEQUENCE)
        update(_length(len(value)))
        for element in value:
            _value(update, element, leaf)
    elif isinstance(value, (dict, Mapping)):
        update(_TAG_MAPPING)
        update(_length(len(value)))
        for key, element in value.items():
            _framed(update, str(key).encode("utf-8"))
            _value(update, element, leaf)
    elif is_media_with_bytes(value):  # vLLM's loaded media: keyed by its bytes (see _media_bytes)
        feed_media_with_bytes(update, value, leaf or _leaf)
    else:
        update(_TAG_LEAF)
        (leaf or _leaf)(update, value)


def _leaf(update: _Update, value: object) -> None:
    if isinstance(value, (bytes, memoryview)):
        _framed(update, value)
    elif isinstance(value, str):
        _framed(update, value.encode("utf-8"))
    elif isinstance(value, (int, float)):
        _framed(update, np.array(value).tobytes())
    elif isinstance(value, np.ndarray):
        _ndarray(update, value)
    elif is_pil_image(value):
        _pil_image(update, value)
    elif is_torch_tensor(value):
        _tensor(update, value)
    else:
        # vLLM pickles what it has no rule for (numpy scalars, a palette's bytearray);
        # records refuse such values in media, so this serves bare hasher calls.
        _framed(update, pickle.dumps(value))


def _ndarray(update: _Update, array: np.ndarray[Any, Any]) -> None:
    if array.ndim and array.flags.c_contiguous:
        # Everything before the bytes depends only on dtype and shape: walked once per
        # such pair, then one update (a video's frames share theirs).
        header_key = (array.dtype.str, array.shape)
        header = _NDARRAY_HEADERS.get(header_key)
        if header is None:
            parts: list[bytes] = []
            _ndarray_header(parts.append, array)
            parts.append(_length(array.nbytes))
            header = b"".join(parts)
            if len(_NDARRAY_HEADERS) >= _MAX_ARRAY_FRAMES:
                _NDARRAY_HEADERS.clear()
            _NDARRAY_HEADERS[header_key] = header
        update(header)
        update(array.view(np.uint8).data)
        return
    _ndarray_header(update, array)
    if array.ndim == 0:
        _value(update, array.item())
        return
    # vLLM hashes array.tobytes(); stream the same C-order bytes block by block.
    update(_length(array.nbytes))
    row_bytes = max(array.nbytes // max(array.shape[0], 1), 1)
    step = max(_BLOCK_BYTES // row_bytes, 1)
    for start in range(0, array.shape[0], step):
        update(np.ascontiguousarray(array[start : start + step]).view(np.uint8).data)


def _ndarray_header(update: _Update, array: np.ndarray[Any, Any]) -> None:
    """The stream up to an array's data: its type, dtype and shape, and the data's name."""
    _framed(update, b"ndarray")
    update(_TAG_MAPPING)
    update(_length(3))
    _framed(update, b"dtype")
    _value(update, array.dtype.str)
    _framed(update, b"shape")
    _value(update, array.shape)
    _framed(update, b"data")
    if array.ndim:
        update(_TAG_LEAF)


def _pil_image(update: _Update, image: Any) -> None:
    image_id = _exif_image_id(image)
    if image_id is not None:
        _framed(update, image_id)
        return
    # vLLM hashes np.asarray(image): Pillow packs the pixels into one bytes object that
    # numpy wraps. We feed the same bytes packed a chunk at a time, with no image copy.
    dtype, shape, nbytes, feed = _pixels(image)
    entries: list[tuple[str, object]] = [("mode", image.mode), ("data", None)]
    palette = image.palette
    if palette is not None:
        entries.append(("palette", palette.palette))
        if palette.rawmode is not None:
            entries.append(("palette_rawmode", palette.rawmode))
    _framed(update, b"image")
    update(_TAG_MAPPING)
    update(_length(len(entries)))
    for name, entry in entries:
        _framed(update, name.encode("utf-8"))
        if name != "data":
            _value(update, entry)
            continue
        update(_TAG_LEAF)
        _framed(update, b"ndarray")
        update(_TAG_MAPPING)
        update(_length(3))
        _framed(update, b"dtype")
        _value(update, dtype)
        _framed(update, b"shape")
        _value(update, shape)
        _framed(update, b"data")
        update(_TAG_LEAF)
        update(_length(nbytes))
        fed = feed(update)
        if fed != nbytes:  # a Pillow whose packing we do not know; never return a wrong key
            raise RuntimeError(f"packed {fed} bytes of {image.mode} pixels, expected {nbytes}")


def _pixels(image: Any) -> tuple[str, tuple[int, ...], int, Callable[[_Update], int]]:
    """dtype string, shape and byte count of ``np.asarray(image)``, and a feeder of its bytes.

    The feeder passes the bytes to ``update`` and returns how many it passed.
    """
    streamed = _streamed_pixels(image) if image.mode in _STREAMED_MODES else None
    if streamed is not None:
        return streamed
    interface = image.__array_interface__
    data: bytes = interface["data"]
    return np.dtype(interface["typestr"]).str, tuple(interface["shape"]), len(data), partial(_fed, (data,))


def _fed(chunks: Iterable[bytes], update: _Update) -> int:
    """Pass ``chunks`` to ``update``; return how many bytes that was.

    blake3 and hashlib let go of the GIL for all but tiny inputs. When another thread
    is busy in Python, getting it back can take a whole switch interval (5 ms) per
    chunk (a 1080p image, when it took this road, 120 ms instead of 2.5 ms). Once an
    update took that long, the remaining chunks are joined and hashed in one update, as
    vLLM does.
    """
    fed = 0
    remaining = iter(chunks)
    clock = time.perf_counter
    for chunk in remaining:
        started = clock()
        update(chunk)
        fed += len(chunk)
        if clock() - started > _GIL_WAIT:
            rest = b"".join(remaining)
            if rest:
                update(rest)
            return fed + len(rest)
    return fed


def _streamed_pixels(image: Any) -> tuple[str, tuple[int, ...], int, Callable[[_Update], int]] | None:
    from PIL import Image, ImageMode  # an image exists, so Pillow is imported already

    try:
        # What Image.__array_interface__ and tobytes() do, without joining the chunks.
        descriptor = ImageMode.getmode(image.mode)
        dtype = np.dtype(descriptor.typestr)
        image.load()
        width, height = image.size
        bands = len(descriptor.bands)
        shape = (height, width) if bands == 1 else (height, width, bands)
        nbytes = width * height * max(bands, 1) * dtype.itemsize
        if image.mode == "RGB" and nbytes >= _OVERLAPPED_BYTES and _band_packing_works():
            return dtype.str, shape, nbytes, partial(_rgb_overlapped, image)
        encoder = Image._getencoder(image.mode, "raw", "L" if image.mode == "1" else image.mode)
    except (AttributeError, KeyError, OSError, TypeError, ValueError):
        return None  # an unfamiliar Pillow: take the copying road
    return dtype.str, shape, nbytes, partial(_fed, _packed(image, encoder, nbytes))


def _packed(image: Any, encoder: Any, nbytes: int) -> Iterator[bytes]:
    if nbytes == 0:
        return
    encoder.setimage(image.im, (0, 0, *image.size))
    bufsize = max(_PIXEL_CHUNK, image.size[0] * 4)  # a whole line at least, as tobytes() does
    try:
        while True:
            _, status, chunk = encoder.encode(bufsize)
            yield chunk
            if status:
                break
    finally:
        encoder.cleanup()
    if status < 0:
        raise RuntimeError(f"encoder error {status} while packing {image.mode} pixels")


def _rgb_overlapped(image: Any, update: _Update) -> int:
    """Feed a large RGB image's packed pixels to ``update`` from a helper thread, packing as it hashes.

    Each band of lines (:func:`_pasted_bands`) is packed into RGB by numpy in one of a
    few slots, and a helper hashes a full slot while this thread pastes and packs the
    next. Pillow's paste, numpy's copy, blake3 and hashlib all let go of the GIL, so the
    two threads seldom wait for it (Pillow's RGB packer and its encoders hold it). Where
    every helper is busy, this thread hashes each slot itself.

    A band that took so long that this thread most likely waited for the GIL (another
    thread busy in Python) ends the bands: the lines left are pasted, packed and hashed
    in one piece each (:func:`_packed_rest`).
    """
    width, height = image.size
    rows = max(_BAND_BYTES // (width * 4), 1)
    free: queue.SimpleQueue[np.ndarray[Any, Any] | None] = queue.SimpleQueue()
    full: queue.SimpleQueue[tuple[np.ndarray[Any, Any], int] | None] = queue.SimpleQueue()
    failures: list[BaseException] = []

    def hash_slots() -> None:
        try:
            while (packed := full.get()) is not None:
                slot, size = packed
                update(slot[:size].data)
                free.put(slot)
        except BaseException as exc:  # noqa: BLE001 - handed to the packing thread, which raises it
            failures.append(exc)
            free.put(None)

    finished = _HELPERS.run(hash_slots)
    for _ in range(_SLOTS if finished is not None else 1):
        free.put(np.empty(rows * width * 3 + 1, np.uint8))  # +1: the last store writes 4 bytes
    fed = 0
    rest: np.ndarray[Any, Any] | None = None
    told = False
    clock = time.perf_counter
    bands = _pasted_bands(image, rows)
    try:
        while (slot := free.get()) is not None:  # None: the helper failed
            started = clock()  # waiting for a free slot (for the helper) does not count
            pixels = next(bands, None)
            if pixels is None:
                break
            _pack_rgbx(slot, pixels)
            size = len(pixels) * 3
            if finished is not None:
                full.put((slot, size))
            else:
                update(slot[:size].data)
                free.put(slot)
            fed += size
            if clock() - started > _GIL_WAIT and fed < width * height * 3:
                if finished is not None:
                    full.put(None)  # no more slots: the helper hashes its last ones meanwhile
                    told = True
                rest = _packed_rest(image, fed // (width * 3))
                break
    finally:
        if finished is not None:
            if not told:
                full.put(None)
            finished.wait()  # the helper has fed its last slot: nothing touches ``update`` after this
    if failures:
        raise failures[0]
    if rest is not None:
        update(rest[:-1].data)
        fed += len(rest) - 1
    return fed


def _packed_rest(image: Any, top: int) -> np.ndarray[Any, Any]:
    """The packed lines of an RGB image from ``top`` on, in one buffer (one spare byte at the end).

    For when another thread keeps the GIL busy: pasting, packing and hashing them in one
    piece each lets go of the GIL three times, not three times a band.
    """
    width, height = image.size
    lines = height - top
    out = np.empty(lines * width * 3 + 1, np.uint8)
    _pack_rgbx(out, next(_pasted_bands(image, lines, top)))
    return out


def _pasted_bands(image: Any, rows: int, top: int = 0) -> Iterator[np.ndarray[Any, Any]]:
    """An RGB image's 4-byte pixels (RGB and a pad byte), ``rows`` lines at a time from line ``top``.

    Pillow's core pastes the lines into an RGBX image that shares its memory with a
    numpy buffer, letting go of the GIL while it copies. The band is ours alone, so it
    is written in place (``Image.paste`` would first copy a shared, read-only image).
    Each band is valid until the next one is pasted; the last may have fewer lines.
    """
    from PIL import Image  # an image exists, so Pillow is imported already

    width, height = image.size
    pixels = np.empty(rows * width, np.uint32)
    band = Image.frombuffer("RGBX", (width, rows), pixels, "raw", "RGBX", 0, 1)
    paste, source = band.im.paste, image.im
    for first in range(top, height, rows):
        paste(source, (0, -first, width, height - first))  # the image moved up, clipped to the band
        yield pixels[: min(rows, height - first) * width]


_Job = tuple[Callable[[], None], threading.Event]  # work, and the event set once it is done


class _Helpers:
    """Threads that run hashing work for packing threads, kept from one call to the next.

    A thread started for each image is slower to get going: 1.76x to 1.80x vLLM's hasher
    for a 4K image against 1.85x to 1.96x with a kept helper, in the same benchmark
    rounds on 2 vCPUs, measured when the pixels still came out of Pillow's encoder
    (docs/benchmarks.md, "What it took"). At most ``limit`` helpers exist (one per
    usable core); they wait, idle and holding nothing, for work. A process forked from
    this one starts with none.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._forget()
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[_Job]] = []
        self._started = 0

    def run(self, work: Callable[[], None]) -> threading.Event | None:
        """Hand ``work`` (which must not raise) to an idle helper; None where none is free.

        The event is set once ``work`` has returned and its helper is idle again, so a
        caller that waits for it finds that helper free for its next call.
        """
        with self._lock:
            if self._idle:
                inbox = self._idle.pop()
            elif self._started < self._limit:
                inbox = queue.SimpleQueue()
                helper = threading.Thread(
                    target=self._serve, args=(inbox,), name="omni-requests hashing", daemon=True
                )
                try:
                    helper.start()
                except RuntimeError:  # no threads to be had (a limit, or shutting down)
                    return None
                self._started += 1
            else:
                return None
        finished = threading.Event()
        inbox.put((work, finished))
        return finished

    def _serve(self, inbox: queue.SimpleQueue[_Job]) -> None:
        while True:
            work, finished = inbox.get()
            work()
            del work  # an idle helper keeps no slots, image or digest alive
            with self._lock:
                self._idle.append(inbox)
            finished.set()


_HELPERS: Final = _Helpers(
    limit=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
)


def _pack_rgbx(out: np.ndarray[Any, Any], pixels: np.ndarray[Any, Any]) -> None:
    """Write the RGB of each 4-byte pixel (a uint32 each) into the start of ``out``.

    Each pixel is stored whole, 4 bytes, 3 bytes after the previous one: in ascending
    order every store's fourth byte is overwritten by the next pixel's first, leaving
    the packed RGB (and one spare byte at the end). A single copy, 7x faster than
    numpy's 3-byte field copy; :func:`_band_packing_works` checks numpy keeps that order.
    """
    stores = np.ndarray((len(pixels),), np.uint32, out, 0, (3,))
    np.copyto(stores, pixels)


@cache
def _band_packing_works() -> bool:
    """Whether pasted bands, packed, give Pillow's own RGB bytes with this Pillow and numpy.

    Checked once, on a probe of several bands and a short last one; where it fails
    (numpy stores in another order, a Pillow that copies instead of sharing the band's
    memory or pastes differently), large RGB images take Pillow's packer instead.
    """
    from PIL import Image  # an image exists, so Pillow is imported already

    width, height, rows = 2053, 7, 3
    probe = Image.frombytes(
        "RGB", (width, height), (np.arange(width * height * 3) * 7 % 251).astype(np.uint8).tobytes()
    )
    out = np.empty(rows * width * 3 + 1, np.uint8)
    packed = []
    try:
        for pixels in _pasted_bands(probe, rows):
            _pack_rgbx(out, pixels)
            packed.append(out[: len(pixels) * 3].tobytes())
    except Exception:  # noqa: BLE001 - any surprise from an unfamiliar Pillow: keep off this road
        return False
    return b"".join(packed) == probe.tobytes()


_EXIF_ORIENTATION: Final = 0x0112


def _as_vllm_parses_image(image: Any) -> Any:
    """``convert_image_mode(normalize_image(image), "RGB")`` of vLLM's image parser.

    Copies only when the parser would change what is hashed: an EXIF orientation or
    ImageID (its transposed copy drops the ImageID), transparency, or a non-RGB mode.
    """
    from PIL import Image, ImageOps  # an image exists, so Pillow is imported already

    try:
        exif = image.getexif()
        transpose = exif.get(_EXIF_ORIENTATION, 1) != 1 or _EXIF_IMAGE_ID in exif
    except Exception:  # noqa: BLE001 - vLLM tolerates malformed EXIF the same way
        transpose = False
    if transpose:
        with contextlib.suppress(Exception):
            image = ImageOps.exif_transpose(image)
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image if image.mode == "RGBA" else image.convert("RGBA")
        flat = Image.new("RGB", rgba.size, (255, 255, 255))
        flat.paste(rgba, mask=rgba.split()[3])
        return flat
    return image if image.mode == "RGB" else image.convert("RGB")


def _exif_image_id(image: Any) -> bytes | None:
    try:
        image_id = image.getexif().get(_EXIF_IMAGE_ID)
    except Exception:  # noqa: BLE001 - vLLM tolerates malformed EXIF the same way
        return None
    return image_id.bytes if isinstance(image_id, uuid.UUID) else None


def _tensor(update: _Update, tensor: Any) -> None:
    import torch  # a tensor exists, so torch is imported already

    tensor = tensor.detach().cpu()
    _framed(update, b"tensor")
    if tensor.dtype == torch.bfloat16:
        flat = tensor.contiguous().view((tensor.numel(),)).view(torch.uint8)
        _value(
            update,
            {
                "original_dtype": str(tensor.dtype),
                "original_shape": tuple(tensor.shape),
                "data": flat.numpy(),
            },
        )
        return
    _value(update, tensor.numpy())


# -- fingerprints: the item's shape of things and a fixed sample of its bytes --


def _sampled(update: _Update, buffer: memoryview, itemsize: int = 1) -> None:
    """Feed ``buffer`` (1-D bytes) whole when small, else ``_SAMPLES`` evenly spaced pieces."""
    nbytes = buffer.nbytes
    update(_length(nbytes))
    if nbytes <= _SAMPLES * _SAMPLE_BYTES:
        update(buffer)
        return
    for start, stop in _sample_spans(nbytes // itemsize, max(_SAMPLE_BYTES // itemsize, 1)):
        update(buffer[start * itemsize : stop * itemsize])


def _sample_spans(count: int, per: int) -> list[tuple[int, int]]:
    """``_SAMPLES`` spans of ``per`` elements out of ``count``, the first and last included."""
    last = count - per
    return [(i * last // (_SAMPLES - 1), i * last // (_SAMPLES - 1) + per) for i in range(_SAMPLES)]


def _fingerprint_leaf(update: _Update, value: object) -> None:
    if isinstance(value, (bytes, memoryview)):
        _sampled(update, memoryview(value).cast("B"))
    elif isinstance(value, str):
        _sampled(update, memoryview(value.encode("utf-8")))
    elif isinstance(value, np.ndarray):
        _framed(update, b"ndarray")
        _sampled_array(update, value, value.dtype.str)
    elif is_pil_image(value):
        _sampled_image(update, value)
    elif is_torch_tensor(value):
        import torch  # a tensor exists, so torch is imported already

        tensor = value.detach().cpu()  # type: ignore[attr-defined]
        _framed(update, b"tensor")
        if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16; same-size view, no copy
            _sampled_array(update, tensor.view(torch.int16).numpy(), str(tensor.dtype))
        else:
            _sampled_array(update, tensor.numpy(), str(tensor.dtype))
    else:
        _leaf(update, value)


def _sampled_array(update: _Update, array: np.ndarray[Any, Any], dtype: str) -> None:
    _value(update, (dtype, array.shape))
    if array.ndim == 0 or array.nbytes <= _SAMPLES * _SAMPLE_BYTES:
        _framed(update, array.tobytes())
    elif array.flags.c_contiguous:
        _sampled(update, array.reshape(-1).view(np.uint8).data, array.itemsize)
    else:  # the same elements a contiguous copy would give, without making one
        per = max(_SAMPLE_BYTES // array.itemsize, 1)
        index = np.concatenate([np.arange(a, b) for a, b in _sample_spans(array.size, per)])
        update(_length(array.nbytes))
        update(np.ascontiguousarray(array.flat[index]).view(np.uint8).data)


def _sampled_image(update: _Update, image: Any) -> None:
    image_id = _exif_image_id(image)
    _framed(update, b"image")
    if image_id is not None:  # vLLM keys the image by this id; so does its fingerprint
        _framed(update, image_id)
        return
    palette = image.palette
    _value(update, (image.mode, image.size, None if palette is None else bytes(palette.palette)))
    width, height = image.size
    rows = sorted({i * (height - 1) // (_SAMPLED_ROWS - 1) for i in range(_SAMPLED_ROWS)}) if height else []
    for row in rows:  # a few whole rows, packed one at a time
        _framed(update, image.crop((0, row, width, row + 1)).tobytes())


def _nbytes_hint(item: object) -> int:
    nbytes = getattr(item, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    if isinstance(item, (tuple, list, PVector)):
        return sum(_nbytes_hint(element) for element in item)
    return 0


class _KeyCache:
    """Digests of items whose bytes cannot change, dropped when one of their arrays dies."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._digests: dict[Hashable, str] = {}
        self._watched: dict[int, tuple[weakref.ref[object], set[Hashable]]] = {}
        # Reads take no lock (a dict read is atomic); the bound method saves a call a read.
        self.get: Callable[[Hashable], str | None] = self._digests.get

    def put(self, key: Hashable, digest: str, leaves: list[object]) -> None:
        with self._lock:
            self._digests[key] = digest
            for leaf in leaves:
                watched = self._watched.get(id(leaf))
                if watched is None:
                    ref = weakref.ref(leaf, self._dropper(id(leaf)))
                    watched = self._watched[id(leaf)] = (ref, set())
                watched[1].add(key)

    def _dropper(self, leaf_id: int) -> Callable[[object], None]:
        def drop(_: object) -> None:
            with self._lock:
                watched = self._watched.pop(leaf_id, None)
                for key in watched[1] if watched else ():
                    self._digests.pop(key, None)

        return drop

    def __len__(self) -> int:
        return len(self._digests)


_CACHE = _KeyCache()

# The bytes around a plain array's data in the digest stream, per (model, modality, dtype,
# shape); see MediaHasher._array_digest. Bounded: media come in few shapes.
_ARRAY_FRAMES: dict[tuple[str, str, str, tuple[int, ...]], tuple[bytes, bytes]] = {}
# An array's header in the stream (see _ndarray), per (dtype, shape); bounded the same way.
_NDARRAY_HEADERS: dict[tuple[str, tuple[int, ...]], bytes] = {}
_MAX_ARRAY_FRAMES: Final = 1024
_UINT8: Final = np.dtype(np.uint8)


def _check_model_id(_: object, attribute: attrs.Attribute[str], value: object) -> None:
    if not isinstance(value, str):
        raise PromptTypeError(f"$.{attribute.name}", f"must be a str, got {type_name(value)}")
    if not value:
        raise InvalidPromptError(f"$.{attribute.name}", "must not be empty")


def _check_algorithm(_: object, attribute: attrs.Attribute[str], value: object) -> None:
    if not isinstance(value, str):  # before `in`: an array's == is elementwise
        raise PromptTypeError(f"$.{attribute.name}", f"must be a str, got {type_name(value)}")
    if value not in _ALGORITHMS:
        raise InvalidPromptError(
            f"$.{attribute.name}", f"must be one of {', '.join(_ALGORITHMS)}, got {value!r}"
        )


@attrs.frozen
class MediaHasher:
    """Computes a media item's content key exactly as vLLM does.

    ``key(modality, item)`` equals vLLM's
    ``MultiModalHasher.hash_kwargs(algorithm, model_id=model_id, **{modality: item})``
    bit for bit. ``model_id`` must be the model string exactly as the engine was given it.

    >>> import numpy as np
    >>> hasher = MediaHasher("my-model")
    >>> len(hasher.key("image", np.zeros((2, 2, 3), dtype=np.uint8)))
    64

    Keys of items whose bytes cannot change (read-only arrays, and tuples or lists of
    them, as records store them) are computed once and reused.

    Large items use more than the calling thread; the digest is the same either way.
    From 8 MiB of bytes blake3 hashes with all cores, and an RGB PIL image of 4 MiB of
    pixels or more is packed on the calling thread while a helper thread hashes what is
    packed. Helpers are daemon threads named ``omni-requests hashing``, at most one per
    usable core, kept idle between calls; a caller that finds none free hashes alone.
    """

    model_id: str = attrs.field(validator=_check_model_id)
    algorithm: HashAlgorithm = attrs.field(default="blake3", validator=_check_algorithm)

    def key(self, modality: str, item: object) -> str:
        """The hex digest vLLM computes for ``item`` under ``modality``."""
        _check_modality(modality)
        return self._cached("key", modality, item, self._digest)

    def content_key(self, modality: str, item: object) -> str:
        """The content base of ``item``'s key: :meth:`key` of the item as vLLM's parser sees it.

        vLLM's parser turns an image upright by its EXIF Orientation and flattens it to RGB
        (transparency over white) before hashing; :meth:`key` of the image as given sees
        neither, so two images the model sees differently could share a key. For them this
        hashes the parsed image, which is also exactly vLLM's own key; every other item
        is hashed as given, like vllm-omni does.
        """
        _check_modality(modality)
        return self._content_key(modality, item)

    def _content_key(self, modality: str, item: object) -> str:
        # content_key for a modality already checked (a record's): on every render's path.
        if modality == "image" and is_pil_image(item):
            # Modes Pillow cannot flatten to RGB (e.g. "La") vLLM cannot parse either:
            # those images are hashed as given.
            with contextlib.suppress(ValueError):
                item = _as_vllm_parses_image(item)
        return self._cached("key", modality, item, self._digest)

    def fingerprint(self, modality: str, item: object) -> str:
        """A cheap digest of ``item``: its types, dtypes, shapes, lengths and a sample of bytes.

        Reads at most ``16 x 4 KiB`` of each buffer (16 rows of an image), whatever its
        size, so it costs microseconds where :meth:`key` costs milliseconds. Equal items
        have equal fingerprints; items that differ in type, shape, length or the sampled
        bytes have different ones; items that differ only between samples do not. It is
        what :attr:`KeyPolicy.bind_content` binds a user UUID to, catching a UUID reused
        for other media; it is no content hash (see ``docs/security.md``).

        >>> import numpy as np
        >>> hasher = MediaHasher("my-model")
        >>> ten_s, thirty_s = np.zeros(160_000, np.float32), np.zeros(480_000, np.float32)
        >>> hasher.fingerprint("audio", ten_s) == hasher.fingerprint("audio", thirty_s)
        False
        """
        _check_modality(modality)
        return self._cached("fingerprint", modality, item, self._fingerprint)

    def _cached(self, kind: str, modality: str, item: object, compute: Callable[[str, object], str]) -> str:
        leaves: list[object]
        token: object
        if type(item) is np.ndarray:  # the common item, without building its token
            if not never_written(item):
                return compute(modality, item)
            leaves, token = [item], ("ndarray", id(item))
        else:
            leaves = []
            token = immutable_token(item, leaves)
            if token is None or not leaves:
                return compute(modality, item)
        cache_key = (kind, self.algorithm, self.model_id, modality, token)
        digest = _CACHE.get(cache_key)
        if digest is None:
            digest = compute(modality, item)
            _CACHE.put(cache_key, digest, leaves)
        return digest

    def _new_hasher(self, nbytes: int) -> Any:
        if self.algorithm != "blake3":
            return hashlib.new(self.algorithm)
        return blake3(max_threads=blake3.AUTO) if nbytes >= _PARALLEL_BYTES else blake3()

    def _digest(self, modality: str, item: object) -> str:
        if type(item) is np.ndarray and item.ndim and item.flags.c_contiguous:
            return self._array_digest(modality, item)
        hasher = self._new_hasher(_nbytes_hint(item))
        update = hasher.update
        for name, value in sorted((("model_id", self.model_id), (modality, item))):
            _named(update, name, value, _leaf)
        digest: str = hasher.hexdigest()
        return digest

    def _array_digest(self, modality: str, array: np.ndarray[Any, Any]) -> str:
        """The common case, a plain contiguous array, in three updates: framing, bytes, framing.

        The framing around the bytes depends only on the model, modality, dtype and
        shape; walking it costs about 8 us a call (30 small updates), so it is built by
        the generic walk once per such combination and reused.
        """
        # blake3 takes a uint8 array as it is; other dtypes through a byte view (0.4 us more).
        data = array if array.dtype is _UINT8 else array.reshape(-1).view(np.uint8).data
        frame_key = (self.model_id, modality, array.dtype.str, array.shape)
        frames = _ARRAY_FRAMES.get(frame_key)
        if frames is None:
            parts: list[Any] = []
            for name, value in sorted((("model_id", self.model_id), (modality, array))):
                _named(parts.append, name, value, _leaf)
            at = next(i for i, part in enumerate(parts) if isinstance(part, memoryview))
            frames = (b"".join(parts[:at]), b"".join(parts[at + 1 :]))
            if len(_ARRAY_FRAMES) >= _MAX_ARRAY_FRAMES:
                _ARRAY_FRAMES.clear()
            _ARRAY_FRAMES[frame_key] = frames
        hasher = self._new_hasher(array.nbytes)
        hasher.update(frames[0])
        hasher.update(data)
        hasher.update(frames[1])
        digest: str = hasher.hexdigest()
        return digest

    def _fingerprint(self, modality: str, item: object) -> str:
        hasher = self._new_hasher(0)
        update = hasher.update
        _framed(update, b"omni-requests fingerprint 1")
        _named(update, modality, item, _fingerprint_leaf)
        digest: str = hasher.hexdigest()
        return digest[:_FINGERPRINT_HEX]


def _check_modality(modality: object) -> None:
    if not isinstance(modality, str):
        raise PromptTypeError("modality", f"must be a str, got {type_name(modality)}")
    if modality == "model_id":
        raise InvalidPromptError("modality", "'model_id' is not a modality name")
