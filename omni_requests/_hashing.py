"""Content keys computed exactly like vLLM's ``MultiModalHasher.hash_kwargs``.

The byte stream fed to the digest follows vLLM >= 0.31: every chunk is preceded by
its length (8 bytes, little endian) and every value by a tag (None, sequence, mapping,
leaf), so distinct inputs cannot produce the same stream. Where vLLM copies (a PIL
image through ``np.asarray``, a non-contiguous array through ``tobytes``) we feed the
same bytes without building the intermediate objects: an image's pixels are packed and
hashed a chunk at a time, never as one image-sized ``bytes`` (a large RGB image is
packed on the calling thread while a helper thread hashes; see :mod:`._image_road`).

:meth:`MediaHasher.fingerprint` is the cheap cousin of a key: type, shape, length and a
fixed sample of the bytes, for binding a user UUID to the item it was given for.
"""

from __future__ import annotations

import contextlib
import hashlib
import pickle
import threading
import uuid
import weakref
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Final, Literal, get_args

import attrs
import numpy as np
from blake3 import blake3
from pyrsistent import PVector

from . import _image_road
from ._errors import NOT_THE_INPUTS, Fault, InvalidPromptError, PromptTypeError, read_or_fault, type_name
from ._exif import EXIF_IMAGE_ID, EXIF_ORIENTATION, exif_of, exif_view, load_image, readable_tags, reading
from ._frozen import refuse_second_init
from ._image_road import pixels
from ._media import (
    IMAGE_MODES,
    MediaKind,
    check_text,
    handout,
    image_size_error,
    immutable_token,
    is_pil_image,
    is_torch_tensor,
    keyed_by_identity,
    media_kind,
    thaw,
)
from ._media_bytes import feed_media_with_bytes, is_media_with_bytes
from ._sealed import Seal, current, seal_of, torch_as_is

__all__ = ["HashAlgorithm", "MediaHasher"]

HashAlgorithm = Literal["blake3", "sha256", "sha512"]
ALGORITHMS: Final[tuple[str, ...]] = get_args(HashAlgorithm)
"""The digests a :class:`MediaHasher` computes, as vLLM's ``MultiModalHasher`` names them."""

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
        feed_media_with_bytes(update, value, _pixels_leaf if leaf is _content_leaf else leaf or _leaf)
    else:
        update(_TAG_LEAF)
        (leaf or _leaf)(update, value)


def _leaf(update: _Update, value: object) -> None:
    # vLLM's serialize_item order, not media_kind's: a bytes-like or number is tested first.
    if isinstance(value, (bytes, memoryview)):
        _framed(update, value)
    elif isinstance(value, str):
        _framed(update, value.encode("utf-8"))
    elif isinstance(value, (int, float)):
        number = np.array(value)
        if number.dtype == object:  # vLLM's bytes would be a memory address: no key at all
            raise ValueError(f"{value} does not fit in 64 bits, so it has no stable key")
        _framed(update, number.tobytes())
    elif type(value) is np.ndarray:
        _ndarray(update, value)
    elif isinstance(value, np.ndarray):
        _ndarray_subclass(update, value)
    elif is_pil_image(value):
        _pil_image(update, value)
    elif is_torch_tensor(value):
        _tensor(update, value)
    else:
        # vLLM pickles what it has no rule for (numpy scalars, a palette's bytearray);
        # records refuse such values in media, so this serves bare hasher calls.
        _framed(update, pickle.dumps(value))


# A content key's Python scalars are hashed after their type (bool before its base, int).
_SCALAR_TYPES: Final = (
    (bool, b"bool"),
    (int, b"int"),
    (float, b"float"),
    (str, b"str"),
    ((bytes, memoryview), b"bytes"),
)


def _pixels_leaf(update: _Update, value: object) -> None:
    """:func:`_leaf` with a PIL image (a video's frame, an image as vLLM's parser made it)
    keyed by its pixels, never by an EXIF ImageID: vLLM's parser stacks a list of frames
    into one array (the ID gone), so frames sharing an ID are different media to vLLM,
    and must be to their keys. What a loaded item (``MediaWithBytes``) is read with in a
    content key: its bytes and the loader's metadata, keyed as vLLM keys them."""
    if is_pil_image(value):
        _pil_image(update, value, by_id=False)
    else:
        _leaf(update, value)


def _loaded(item: object) -> bool:
    """Whether ``item`` is vLLM's loaded media: a ``MediaWithBytes``, or a video's
    ``(MediaWithBytes(frames, data), metadata)`` as vLLM's parser splits the loader's."""
    if type(item) is tuple and len(item) == 2:
        item = item[0]
    return is_media_with_bytes(item)


def _content_leaf(update: _Update, value: object) -> None:
    """:func:`_pixels_leaf` for a content key, a Python scalar keyed with its type: vLLM's
    hasher hashes 1 and 5e-324 (or "abc" and b"abc") as the same bytes, but its parser
    makes an audio list ``[0.5, 1]`` the array ``[0.5, 1.0]`` and ``[0.5, 5e-324]``
    another, which the model hears apart (found by a review, helper-83)."""
    for kind, name in _SCALAR_TYPES:
        if isinstance(value, kind):
            _framed(update, name)
            break
    _pixels_leaf(update, value)


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


def _ndarray_subclass(update: _Update, array: np.ndarray[Any, Any]) -> None:
    """An ndarray subclass, step by step as vLLM walks it: a subclass's ``view(...).data``
    and ``tobytes()`` may be its own (a masked array's are an array and the filled values).
    Records never hold one (they store a plain copy); this serves bare hasher calls."""
    data: object
    if array.ndim == 0:
        data = array.item()
    elif array.flags.c_contiguous:
        data = array.view(np.uint8).data
    else:
        data = array.tobytes()
    _framed(update, b"ndarray")
    _value(update, {"dtype": array.dtype.str, "shape": array.shape, "data": data})


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


def _pil_image(update: _Update, image: Any, by_id: bool = True) -> None:
    image_id = _exif_image_id(image) if by_id else None
    if image_id is not None:
        _framed(update, image_id)
        return
    _check_image_size(image)
    # vLLM hashes np.asarray(image): Pillow packs the pixels into one bytes object that
    # numpy wraps. We feed the same bytes packed a chunk at a time, with no image copy.
    dtype, shape, nbytes, feed = pixels(image)  # the fast road, or Pillow's copy (see _image_road)
    entries: list[tuple[str, object]] = [("mode", image.mode), ("data", None)]
    palette = image.palette
    if palette is not None:
        entries.append(("palette", palette.palette))
        if palette.rawmode is not None:
            entries.append(("palette_rawmode", palette.rawmode))
        if not by_id:
            # For a content key: one palette's bytes read as RGB or as RGBA are other
            # colours (vLLM's hasher, which ours mirrors by_id, reads no palette mode).
            entries.append(("palette_mode", palette.mode))
    if not by_id and "transparency" in image.info:
        # For a content key: a processor given the image as it is (in a list as one item)
        # composites a transparency entry onto white (transformers' convert_to_rgb), so
        # the entry is content too. vLLM's hasher, which ours mirrors by_id, reads none.
        entries.append(("transparency", _transparency_entry(image.info["transparency"])))
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


def _as_vllm_parses_image(image: Any) -> Any:
    """``convert_image_mode(normalize_image(image), "RGB")`` of vLLM's image parser.

    Copies only when the parser would change what is hashed: an EXIF orientation or
    ImageID (its transposed copy drops the ImageID), transparency, a non-RGB mode, or an
    RGB image holding a palette (a GIF's later frames): exif_transpose copies even where
    it turns nothing, and Pillow's copy keeps a palette only for P and PA.

    Where vLLM versions give the model other pixels, both: vLLM 0.34 flattens an RGB
    image's transparency entry over white, and 0.32 and before hand the image on as it
    is (their ``convert_image_mode`` returns an image already in the mode first). Where a
    pixel has the transparent colour the two differ, and ``(flattened, as_is)`` is what
    is hashed, so no two images some version sees apart share a key.
    """
    from PIL import ImageChops, ImageOps  # an image exists, so Pillow is imported already

    # Loaded first, as exif_transpose loads: a PNG's XMP may follow its pixels (helper-91).
    load_image(image)
    # EXIF Pillow cannot read makes exif_transpose raise too: vLLM keeps the image.
    tags = readable_tags(image)
    if not isinstance(tags, Fault):
        if tags.get(EXIF_ORIENTATION, 1) != 1 or EXIF_IMAGE_ID in tags:
            # Of a view over the pixels: Pillow's would fill the caller's image's EXIF cache.
            upright = read_or_fault(lambda: ImageOps.exif_transpose(exif_view(image)))
            if not isinstance(upright, Fault):  # else vLLM keeps the image as it is
                image = upright
        elif image.mode == "RGB" and image.palette is not None:
            image = image.copy()  # what exif_transpose returns here
        elif image.mode == "P" and "transparency" in image.info:
            # Pillow's convert writes the transparency into the image's own palette:
            # convert a copy, as vLLM converts exif_transpose's, never the caller's.
            image = image.copy()
    flat = _flattened_as_vllm(image)
    # Compared in Pillow's C code (copying both to bytes took 8x as long at 1080p).
    if image.mode == "RGB" and flat is not image and ImageChops.difference(flat, image).getbbox() is not None:
        return (flat, image)  # flattened only by vLLM 0.34 (see above)
    return flat


# The field a key of an image's two parses carries beside the model and the modality:
# no other key has a third field, and named fields frame apart.
_TWO_PARSES: Final = ("vllm image parses", "0.34 flattened, 0.32 as is")


def image_parses(image: Any) -> tuple[Any, ...]:
    """The images vLLM versions give the model for a PIL ``image`` under ``image``: one,
    or both where they differ (:func:`_as_vllm_parses_image`); none where vLLM cannot
    parse it."""
    try:
        parsed = _as_vllm_parses_image(image)
    except ValueError:
        return ()
    return parsed if isinstance(parsed, tuple) else (parsed,)


def _flattened_as_vllm(image: Any) -> Any:
    """``convert_image_mode(image, "RGB")`` of vLLM: transparency over white, then RGB."""
    from PIL import Image  # an image exists, so Pillow is imported already

    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image if image.mode == "RGBA" else image.convert("RGBA")
        flat = Image.new("RGB", rgba.size, (255, 255, 255))
        flat.paste(rgba, mask=rgba.split()[3])
        return flat
    return image if image.mode == "RGB" else image.convert("RGB")


# The modes records take that vLLM's parser turns into RGB, without a transparency.
_CONVERTIBLE_MODES: Final = frozenset(IMAGE_MODES) - {"La"}


def rgb_conversion_error(image: Any) -> Exception | None:
    """What vLLM's image parser raises turning ``image`` into RGB, or None where it can.

    It fails on mode "La" and on a transparency Pillow cannot apply (5.0 on an L image,
    four values on an RGB one, a tuple on a P one), which depends on the image's mode,
    palette and ``info``, never its pixels: so it is tried on a 1x1 crop (microseconds),
    and only for such images. Every other mode records take converts (tested); and Pillow
    lets go of the GIL to crop, which beside a thread busy in Python can cost a switch
    interval. An image that cannot be read is not judged here (freezing it names that error).
    """
    if "transparency" not in image.info and image.mode in _CONVERTIBLE_MODES:
        return None
    try:
        stand_in = image.crop((0, 0, 1, 1))  # mode, palette and info kept; the caller's untouched
    except NOT_THE_INPUTS:  # a timeout or no memory: never taken for the input's
        raise
    except Exception:  # noqa: BLE001 - the image cannot be read: not this check's to report
        return None
    try:
        _flattened_as_vllm(stand_in)
    except NOT_THE_INPUTS:  # a timeout or no memory: never taken for the input's
        raise
    except Exception as error:  # noqa: BLE001 - whatever Pillow raises, vLLM's parser raises
        return error
    return None


def _transparency_entry(value: object) -> object:
    """A transparency entry as a content key hashes it: typed (Pillow composites 5 and
    fails on 5.0 or np.uint8(5)), and never by repr, which prints numpy scalars by the
    process's print options. A value of another type is hashed by its type alone: Pillow
    composites none, so no model input follows from it."""
    if type(value) in (tuple, list):
        return [type(value).__name__, *map(_transparency_entry, value)]  # type: ignore[call-overload]
    if type(value) is int:
        return ["int", str(value)]
    if type(value) is bytes:
        return ["bytes", value]
    if isinstance(value, np.integer) and type(value).__module__ == "numpy":
        return [value.dtype.str, str(int(value))]
    return [f"{type(value).__module__}.{type(value).__qualname__}"]


# What Pillow's exif_transpose (in vLLM's parser) looks an orientation up in: 6.0,
# np.int64(6) and IFDRational(6, 1) find 6 there; 1, 9 or "6" find nothing.
_TURNS: Final = {n: n for n in range(2, 9)}


def vllm_turn(image: Any) -> int | None:
    """The turn vLLM's parser makes of ``image`` by its EXIF orientation (2 to 8), or None
    where it makes none: no orientation, one the lookup does not find (or cannot hash), or
    a transpose that fails (an ``info["xmp"]`` that is no text, say), which vLLM's parser
    suppresses, keeping the image as it is.

    Whether it fails depends on the image's mode, ``info`` and EXIF, never its pixels, so
    a found turn is tried on a 1x1 stand-in holding those (microseconds; the image's own
    transpose took 23 ms at 4K).
    """
    from PIL import Image, ImageOps  # an image exists, so Pillow is imported already

    load_image(image)  # as exif_transpose loads first: a PNG's XMP may follow its pixels
    # Malformed EXIF or an unhashable value: no turn, as in vLLM.
    exif = read_or_fault(lambda: exif_of(image))
    if isinstance(exif, Fault):
        return None
    turn = read_or_fault(lambda: _TURNS.get(exif.get(EXIF_ORIENTATION)))
    if turn is None or isinstance(turn, Fault):
        return None
    try:
        stand_in = Image.new(image.mode, (1, 1))
    except NOT_THE_INPUTS:  # a timeout or no memory: never taken for the input's
        raise
    except Exception:  # noqa: BLE001 - a mode Image.new cannot make: a view of the image itself
        stand_in = exif_view(image)
    else:
        stand_in.info = dict(image.info)
        reading(stand_in, exif)  # read, never written: the transposed copy gets its own
    # A transpose that fails, vLLM's parser suppresses the same way.
    transposed = read_or_fault(lambda: ImageOps.exif_transpose(stand_in))
    return None if isinstance(transposed, Fault) else turn


def _parsed_as(image: Any) -> tuple[object, object]:
    """What vLLM's parser does with an image besides its pixels, mode and palette: the
    turn it makes, and the transparency entry as the content key hashes it (typed: 5.0
    fails where 5 flattens; never by repr, which follows numpy's print options). Images
    alike here and in those parse alike, and equal records, keys and fingerprints follow
    it in any process."""
    return vllm_turn(image), _transparency_entry(image.info.get("transparency"))


def _exif_image_id(image: Any) -> bytes | None:
    tags = readable_tags(image)  # vLLM tolerates malformed EXIF the same way
    image_id = None if isinstance(tags, Fault) else tags.get(EXIF_IMAGE_ID)
    return image_id.bytes if isinstance(image_id, uuid.UUID) else None


def _tensor(update: _Update, tensor: Any) -> None:
    import torch  # a tensor exists, so torch is imported already

    with torch_as_is(tensor):
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
    media: Any = value
    kind = media_kind(value)
    if isinstance(value, (bytes, memoryview)):
        _sampled(update, memoryview(value).cast("B"))
    elif isinstance(value, str):
        _sampled(update, memoryview(value.encode("utf-8")))
    elif kind is MediaKind.ARRAY:
        _framed(update, b"ndarray")
        _sampled_array(update, media, media.dtype.str)
    elif kind is MediaKind.IMAGE:
        _sampled_image(update, media)
    elif kind is MediaKind.TENSOR:
        import torch  # a tensor exists, so torch is imported already

        with torch_as_is(media):
            tensor = media.detach().cpu()
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


def _check_image_size(image: Any) -> None:
    load_image(image)  # a file image decodes on first use
    wrong_size = image_size_error(image)
    if wrong_size is not None:
        raise ValueError(wrong_size)


def _sampled_image(update: _Update, image: Any) -> None:
    _check_image_size(image)
    # Never by an EXIF ImageID, under any modality: vLLM's parser drops the ID, so two
    # images sharing one are two inputs to the model, and content_key tells them apart.
    _framed(update, b"image")
    palette = image.palette
    _value(update, (image.mode, image.size, None if palette is None else bytes(palette.palette)))
    # What vLLM's parser reads besides the pixels (content_key hashes the parsed image):
    # a key that changes with these must give a fingerprint that does too.
    _value(update, _parsed_as(image))
    width, height = image.size
    rows = sorted({i * (height - 1) // (_SAMPLED_ROWS - 1) for i in range(_SAMPLED_ROWS)}) if height else []
    for row in rows:  # a few whole rows, packed one at a time
        _framed(update, image.crop((0, row, width, row + 1)).tobytes())


# Parts of a multi-part item of at least this many bytes are timed (see _Gathering).
_TIMED_PART_BYTES: Final = 1 << 20
# The slowest a part is expected to hash, in bytes a second, on one core of any server:
# blake3 hashes 2 to 5 GB/s, sha256 and sha512 0.3 to 2 GB/s. Slower, it waited.
_SLOWEST_HASH: Final = {"blake3": 1e9, "sha256": 2e8, "sha512": 2e8}
# Gathered bytes are hashed (one wait each) whenever this many are waiting: a bounded
# copy, and a bounded time holding the GIL for it.
_GATHERED_MAX: Final = 64 << 20


class _Gathering:
    """The ``update`` of an item in several parts (a list of frames, say).

    blake3 and hashlib let go of the GIL for each large update, and beside a thread busy
    in Python getting it back can cost a switch interval (5 ms) each time: a 16-frame
    video paid about 16 of them, as vLLM's hasher does. Each large part is timed; once
    one took longer than hashing explains, or while a recent wait says the GIL is
    contended (see ``_image_road``), the rest of the item is gathered into one buffer,
    copied with the GIL held, and hashed in one update at the end (or at each
    ``_GATHERED_MAX`` bytes): one wait, not one a part. The digest is the same: a hash of
    the same bytes in order.
    """

    __slots__ = ("_gathered", "_slowest", "_update")

    def __init__(self, update: _Update, algorithm: str) -> None:
        self._update = update
        self._slowest = _SLOWEST_HASH[algorithm]
        self._gathered: bytearray | None = bytearray() if _image_road.contended() else None

    def __call__(self, data: Any) -> None:
        gathered = self._gathered
        if gathered is not None:
            if _gathers(data):
                gathered += data
                if len(gathered) >= _GATHERED_MAX:
                    self.finish()
                return
            # A part as large as the bound costs one wait whether copied or not; a buffer
            # the digest would refuse must be refused as it would be fed directly.
            self.finish()
            self._update(data)
            return
        nbytes = data.nbytes if isinstance(data, memoryview) else len(data)
        if nbytes < _TIMED_PART_BYTES:
            self._update(data)
            return
        started = _image_road._clock()
        self._update(data)
        if _image_road.waited_for_the_gil(started, nbytes, self._slowest):
            self._gathered = bytearray()

    def finish(self) -> None:
        """Hashes what was gathered (in order, before any later part)."""
        gathered = self._gathered
        if gathered:
            self._update(gathered)
            gathered.clear()


def _gathers(data: Any) -> bool:
    """Whether ``data`` is gathered: bytes, or a contiguous byte memoryview, under the bound.

    A 0-d view (a scalar's bytes) is fed as it is: blake3 refuses it, bytearray would not.
    """
    if isinstance(data, memoryview):
        byte_buffer = data.format in ("B", "b", "c") and data.ndim >= 1 and data.c_contiguous
        return byte_buffer and data.nbytes < _GATHERED_MAX
    return isinstance(data, bytes) and len(data) < _GATHERED_MAX


def _nbytes_hint(item: object) -> int:
    try:
        nbytes = getattr(item, "nbytes", None)
    except NOT_THE_INPUTS:  # a timeout or no memory: never taken for the input's
        raise
    except Exception:  # noqa: BLE001 - a sparse tensor's raises: a hint only, the hash says what fails
        return 0
    if isinstance(nbytes, int):
        return nbytes
    if isinstance(item, (tuple, list, PVector)):
        return sum(_nbytes_hint(element) for element in item)
    return 0


# The most digests kept for one array or seal (each key also names the scalars beside it).
_KEYS_PER_OBJECT: Final = 64


class _KeyCache:
    """Digests of items whose bytes cannot change, dropped when one of their arrays dies.

    Each digest is kept with weak references to the objects its key names by id, and a
    read finds it only while every one of them is alive: dropping and putting are several
    steps, and a signal handler that raises (a request timeout) can stop one halfway,
    leaving a digest whose objects are dead. Read unchecked, the next object given that
    id would have been keyed as the dead one (found by a review, helper-84).
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._digests: dict[Hashable, tuple[str, tuple[weakref.ref[object], ...]]] = {}
        # Per watched object, the keys naming it, oldest first.
        self._watched: dict[int, tuple[weakref.ref[object], dict[Hashable, None]]] = {}

    def get(self, key: Hashable) -> str | None:
        entry = self._digests.get(key)  # a dict read is atomic: no lock
        if entry is None:
            return None
        for ref in entry[1]:
            if ref() is None:  # left by a drop cut short: its id may name another object now
                with self._lock:
                    if self._digests.get(key) is entry:
                        del self._digests[key]
                return None
        return entry[0]

    def put(self, key: Hashable, digest: str, leaves: list[object]) -> None:
        with self._lock:
            refs = []
            for leaf in leaves:
                watched = self._watched.get(id(leaf))
                if watched is None or watched[0]() is not leaf:  # none, or a dead one's
                    ref = weakref.ref(leaf, self._dropper(id(leaf)))
                    watched = self._watched[id(leaf)] = (ref, {})
                keys = watched[1]
                keys[key] = None
                if len(keys) > _KEYS_PER_OBJECT:
                    # A live template array beside ever new scalars (an audio's rate, a
                    # video's fps) would add entries without end: its oldest goes.
                    oldest = next(iter(keys))
                    del keys[oldest]
                    self._digests.pop(oldest, None)
                refs.append(watched[0])
            self._digests[key] = (digest, tuple(refs))

    def _dropper(self, leaf_id: int) -> Callable[[object], None]:
        def drop(ref: object) -> None:
            with self._lock:
                watched = self._watched.get(leaf_id)
                if watched is None or watched[0] is not ref:  # the id was watched anew since
                    return
                del self._watched[leaf_id]
                for key in watched[1]:
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
    check_text(f"$.{attribute.name}", value)


def _check_algorithm(_: object, attribute: attrs.Attribute[str], value: object) -> None:
    if not isinstance(value, str):  # before `in`: an array's == is elementwise
        raise PromptTypeError(f"$.{attribute.name}", f"must be a str, got {type_name(value)}")
    if value not in ALGORITHMS:
        raise InvalidPromptError(
            f"$.{attribute.name}", f"must be one of {', '.join(ALGORITHMS)}, got {value!r}"
        )


@attrs.frozen(getstate_setstate=False)
class MediaHasher:
    """Computes a media item's content key exactly as vLLM does.

    ``key(modality, item)`` equals vLLM's
    ``MultiModalHasher.hash_kwargs(algorithm, model_id=model_id, **{modality: item})``
    bit for bit, except for an int beyond 64 bits, which has no key here (``ValueError``):
    vLLM hashes the memory address of its object. ``model_id`` must be the model string
    exactly as the engine was given it.

    An item vLLM's hasher cannot hash raises what it raises there, as vLLM would (an
    object array ``TypeError``, a sparse, nested or meta tensor torch's error, a lone
    surrogate ``UnicodeEncodeError``, a list nested thousands deep ``RecursionError``):
    it has no key. Records refuse such items by name when they are built, before any key.

    >>> import numpy as np
    >>> hasher = MediaHasher("my-model")
    >>> len(hasher.key("image", np.zeros((2, 2, 3), dtype=np.uint8)))
    64

    Keys of items whose bytes cannot change (the arrays records hold, and tuples or a
    record's own item lists of them; a plain list can change, so it is hashed each time)
    are computed once and reused; see ``docs/design.md``.

    Large items use more than the calling thread; the digest is the same either way.
    From 8 MiB of bytes blake3 hashes with all cores, and an RGB PIL image of 4 MiB of
    pixels or more is packed on the calling thread while a helper thread hashes what is
    packed. Helpers are daemon threads named ``omni-requests hashing``, at most one per
    usable core, kept idle between calls; a caller that finds none free hashes alone.
    """

    model_id: str = attrs.field(validator=_check_model_id)
    algorithm: HashAlgorithm = attrs.field(default="blake3", validator=_check_algorithm)

    def __attrs_pre_init__(self) -> None:
        refuse_second_init(self, "model_id")  # keys cached under the hasher would go stale

    def __reduce__(self) -> tuple[type[MediaHasher], tuple[str, str]]:
        return (type(self), (self.model_id, self.algorithm))  # through the constructor: checked again

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
        is hashed as given, like vllm-omni does, except that a PIL image inside it (a
        video's frame) is hashed by its pixels, never by an EXIF ImageID: vLLM stacks
        such frames into one array, so frames sharing an ID are different media to it;
        and that an image loaded by vLLM (``MediaWithBytes``) is hashed by its bytes, even
        with an EXIF ImageID set in memory, which vLLM's own key would be.
        """
        _check_modality(modality)
        return self._content_key(modality, item, record=False)

    def _content_key(self, modality: str, item: object, *, record: bool = True) -> str:
        # content_key for a modality already checked; by default of a record's item (a
        # record's view read as its seal), on every render's path.
        if modality != "image" or not is_pil_image(item):
            # Images inside an item (video frames, a list of images as one image item, a
            # loaded image's wrapper) are keyed by their pixels, never by an in-memory EXIF
            # ImageID: vLLM's hasher keys them by the ID (its parser keeps them as they
            # are), but the model sees the pixels, so one ID over two would be one entry.
            return self._cached("content", modality, item, self._pixels_digest, record=record)
        seal = seal_of(item) if record else None
        if seal is not None:  # parsed once, from the seal, and cached by it
            return self._cached_by_seal(modality, seal)
        # Modes Pillow cannot flatten to RGB (e.g. "La") vLLM cannot parse either: those
        # images are hashed as given.
        with contextlib.suppress(ValueError):
            item = _as_vllm_parses_image(current(item) if record else item)
        return self._cached("content", modality, item, self._parsed_image_digest, record=record)

    def _record_fingerprint(self, modality: str, item: object) -> str:
        # fingerprint of a record's item (a view read as its seal), modality checked
        return self._cached("fingerprint", modality, item, self._fingerprint, record=True)

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

    def _cached(
        self,
        kind: str,
        modality: str,
        item: object,
        compute: Callable[[str, object], str],
        *,
        record: bool = False,
    ) -> str:
        """``compute(modality, item)``, cached where the item's bytes cannot change.

        ``record``: ``item`` is a record's, whose arrays are read as made and whose views
        are read as their seals (cached by the seal, computed from a hand-out), whatever
        their holders did to them. Otherwise an array or view is read as it is now, and
        cached only while it is as made: its holder may have changed it.
        """
        leaves: list[object]
        token: object
        array: np.ndarray[Any, Any] | None = None
        if type(item) is np.ndarray:  # the common item, without building its token
            if not keyed_by_identity(item, record=record):
                return compute(modality, item)
            array, leaves, token = item, [item], ("ndarray", id(item))
        else:
            leaves = []
            token = immutable_token(item, leaves, sealed=record)
            if token is None or not leaves:
                return compute(modality, thaw(item) if record else item)
        cache_key = (kind, type(self), self.algorithm, self.model_id, modality, token)
        digest = _CACHE.get(cache_key)
        if digest is None:
            # From the arrays as made (fresh views of them), which the token stands for:
            # read from the arrays themselves, a shape or dtype set in place meanwhile
            # (another thread, a finalizer) would be hashed, and its key served once the
            # layout is restored.
            digest = compute(modality, handout(array) if array is not None else thaw(item))
            _CACHE.put(cache_key, digest, leaves)
        return digest

    def _cached_by_seal(self, modality: str, seal: Seal) -> str:
        cache_key = ("content", type(self), self.algorithm, self.model_id, modality, ("sealed", id(seal)))
        digest = _CACHE.get(cache_key)
        if digest is None:
            image = seal.handout()
            with contextlib.suppress(ValueError):
                image = _as_vllm_parses_image(image)
            digest = self._parsed_image_digest(modality, image)
            _CACHE.put(cache_key, digest, [seal])
        return digest

    def _new_hasher(self, nbytes: int) -> Any:
        if self.algorithm != "blake3":
            return hashlib.new(self.algorithm)
        return blake3(max_threads=blake3.AUTO) if nbytes >= _PARALLEL_BYTES else blake3()

    def _pixels_digest(self, modality: str, item: object) -> str:
        # A loaded item (a video as vLLM's parser splits it too) as vLLM keys it: by its
        # bytes, with the loader's metadata, whose types the loader fixes.
        return self._digest(modality, item, _pixels_leaf if _loaded(item) else _content_leaf)

    def _parsed_image_digest(self, modality: str, parsed: Any) -> str:
        """The digest of what vLLM's parser makes of an image (:func:`_as_vllm_parses_image`),
        by its pixels: an image it could not turn upright keeps its ImageID, which must not
        stand for them. Two parses are hashed under a field of their own, so that their
        key is never a list of two images' (a tuple would be hashed as one)."""
        if isinstance(parsed, tuple):
            return self._digest(modality, parsed, _content_leaf, _TWO_PARSES)
        return self._digest(modality, parsed, _content_leaf)

    def _digest(self, modality: str, item: object, leaf: _Leaf = _leaf, *extra: tuple[str, object]) -> str:
        if type(item) is np.ndarray and item.ndim and item.flags.c_contiguous and not extra:
            return self._array_digest(modality, item)
        nbytes = _nbytes_hint(item)
        hasher = self._new_hasher(nbytes)
        update: _Update = hasher.update
        gathering = _Gathering(update, self.algorithm) if nbytes >= 2 * _TIMED_PART_BYTES else None
        for name, value in sorted((("model_id", self.model_id), (modality, item), *extra)):
            # The model string as vLLM frames it, whatever the item's leaves are read as
            # (no modality or extra field is named so).
            _named(gathering or update, name, value, _leaf if name == "model_id" else leaf)
        if gathering is not None:
            gathering.finish()
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
    check_text("modality", modality)
