"""Content keys computed exactly like vLLM's ``MultiModalHasher.hash_kwargs``.

The byte stream fed to the digest follows vLLM >= 0.31: every chunk is preceded by
its length (8 bytes, little endian) and every value by a tag (None, sequence, mapping,
leaf), so distinct inputs cannot produce the same stream. Where vLLM copies (a PIL
image through ``np.asarray``, a non-contiguous array through ``tobytes``) we feed the
same bytes without building the intermediate objects.
"""

from __future__ import annotations

import hashlib
import pickle
import threading
import uuid
import weakref
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Final, Literal

import attrs
import numpy as np
from blake3 import blake3
from pyrsistent import PVector

from ._errors import InvalidPromptError, PromptTypeError, type_name
from ._media import immutable_token, is_pil_image, is_torch_tensor

__all__ = ["HashAlgorithm", "MediaHasher"]

HashAlgorithm = Literal["blake3", "sha256", "sha512"]
_ALGORITHMS: Final = ("blake3", "sha256", "sha512")

_TAG_NONE: Final = b"\x00"
_TAG_SEQUENCE: Final = b"\x01"
_TAG_MAPPING: Final = b"\x02"
_TAG_LEAF: Final = b"\x03"

# Above this size blake3 hashes with every core; the digest is the same either way.
_PARALLEL_BYTES: Final = 8 << 20
# Non-contiguous arrays are streamed in C order in blocks of about this size.
_BLOCK_BYTES: Final = 16 << 20
# EXIF tag 0x800D, "ImageID" (PIL.ExifTags.Base.ImageID): vLLM keys an image by this UUID when set.
_EXIF_IMAGE_ID: Final = 0x800D

_Update = Callable[[Any], object]


def _length(value: int) -> bytes:
    return value.to_bytes(8, "little")


def _framed(update: _Update, chunk: bytes | memoryview) -> None:
    update(_length(chunk.nbytes if isinstance(chunk, memoryview) else len(chunk)))
    update(chunk)


def _named(update: _Update, name: str, value: object) -> None:
    _framed(update, name.encode("utf-8"))
    _value(update, value)


def _value(update: _Update, value: object) -> None:
    if value is None:
        update(_TAG_NONE)
    elif isinstance(value, (list, tuple, PVector)):
        update(_TAG_SEQUENCE)
        update(_length(len(value)))
        for element in value:
            _value(update, element)
    elif isinstance(value, (dict, Mapping)):
        update(_TAG_MAPPING)
        update(_length(len(value)))
        for key, element in value.items():
            _framed(update, str(key).encode("utf-8"))
            _value(update, element)
    else:
        update(_TAG_LEAF)
        _leaf(update, value)


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
    _framed(update, b"ndarray")
    update(_TAG_MAPPING)
    update(_length(3))
    _framed(update, b"dtype")
    _value(update, array.dtype.str)
    _framed(update, b"shape")
    _value(update, array.shape)
    _framed(update, b"data")
    if array.ndim == 0:
        _value(update, array.item())
        return
    update(_TAG_LEAF)
    if array.flags.c_contiguous:
        _framed(update, array.view(np.uint8).data)
        return
    # vLLM hashes array.tobytes(); stream the same C-order bytes block by block.
    update(_length(array.nbytes))
    row_bytes = max(array.nbytes // max(array.shape[0], 1), 1)
    step = max(_BLOCK_BYTES // row_bytes, 1)
    for start in range(0, array.shape[0], step):
        update(np.ascontiguousarray(array[start : start + step]).view(np.uint8).data)


def _pil_image(update: _Update, image: Any) -> None:
    image_id = _exif_image_id(image)
    if image_id is not None:
        _framed(update, image_id)
        return
    # np.asarray(image) reads __array_interface__; use it directly and skip the array.
    interface = image.__array_interface__
    pixels: bytes = interface["data"]
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
        _value(update, np.dtype(interface["typestr"]).str)
        _framed(update, b"shape")
        _value(update, tuple(interface["shape"]))
        _framed(update, b"data")
        update(_TAG_LEAF)
        _framed(update, pixels)


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

    def get(self, key: Hashable) -> str | None:
        return self._digests.get(key)

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


def _check_model_id(_: object, attribute: attrs.Attribute[str], value: object) -> None:
    if not isinstance(value, str):
        raise PromptTypeError(f"$.{attribute.name}", f"must be a str, got {type_name(value)}")
    if not value:
        raise InvalidPromptError(f"$.{attribute.name}", "must not be empty")


def _check_algorithm(_: object, attribute: attrs.Attribute[str], value: object) -> None:
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
    """

    model_id: str = attrs.field(validator=_check_model_id)
    algorithm: HashAlgorithm = attrs.field(default="blake3", validator=_check_algorithm)

    def key(self, modality: str, item: object) -> str:
        """The hex digest vLLM computes for ``item`` under ``modality``."""
        if not isinstance(modality, str):
            raise PromptTypeError("modality", f"must be a str, got {type_name(modality)}")
        if modality == "model_id":
            raise InvalidPromptError("modality", "'model_id' is not a modality name")
        leaves: list[object] = []
        token = immutable_token(item, leaves)
        if token is None or not leaves:
            return self._digest(modality, item)
        cache_key = (self.algorithm, self.model_id, modality, token)
        digest = _CACHE.get(cache_key)
        if digest is None:
            digest = self._digest(modality, item)
            _CACHE.put(cache_key, digest, leaves)
        return digest

    def _digest(self, modality: str, item: object) -> str:
        hasher: Any
        if self.algorithm == "blake3":
            parallel = _nbytes_hint(item) >= _PARALLEL_BYTES
            hasher = blake3(max_threads=blake3.AUTO) if parallel else blake3()
        else:
            hasher = hashlib.new(self.algorithm)
        update = hasher.update
        for name, value in sorted((("model_id", self.model_id), (modality, item))):
            _named(update, name, value)
        digest: str = hasher.hexdigest()
        return digest
