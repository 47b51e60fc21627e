"""Freezing media payloads and options, and telling which frozen payloads can never change.

vLLM hands these values to processors and hashers that test for ``list``, ``tuple`` and
``dict``; records store them frozen (``PVector``, ``tuple``, :class:`FrozenDict`, read-only
arrays) and :func:`thaw` gives the engine back the plain shapes it expects.
"""

from __future__ import annotations

import pickle
import struct
import sys
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, Final, TypeVar

import numpy as np
from pyrsistent import PMap, PVector, pmap, pvector

from ._errors import InvalidPromptError, PromptTypeError, type_name
from ._media_bytes import freeze_media_with_bytes, is_media_with_bytes

__all__ = ["FrozenDict"]

_K = TypeVar("_K")
_V = TypeVar("_V")


class FrozenDict(Mapping[_K, _V]):
    """An immutable mapping that keeps insertion order.

    vLLM hashes mappings (video metadata, processor kwargs) in insertion order, and
    pyrsistent's ``PMap`` has none, so options and metadata use this instead.
    """

    __slots__ = ("__weakref__", "_data", "_hash")

    _data: dict[_K, _V]
    _hash: int | None

    def __init__(self, data: Mapping[_K, _V] | None = None) -> None:
        object.__setattr__(self, "_data", dict(data) if data is not None else {})
        object.__setattr__(self, "_hash", None)

    def __getitem__(self, key: _K) -> _V:
        return self._data[key]

    def __iter__(self) -> Iterator[_K]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"FrozenDict({self._data!r})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, FrozenDict):
            return self._data == other._data
        if isinstance(other, Mapping):
            return self._data == dict(other)
        return NotImplemented

    def __hash__(self) -> int:
        if self._hash is None:
            object.__setattr__(self, "_hash", hash(tuple(self._data.items())))
        return self._hash  # type: ignore[return-value]

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __reduce__(self) -> tuple[type[FrozenDict[_K, _V]], tuple[dict[_K, _V]]]:
        return (type(self), (self._data,))


def is_torch_tensor(value: object) -> bool:
    """True for a ``torch.Tensor``, without importing torch (no tensor exists before it is)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def is_pil_image(value: object) -> bool:
    """True for a ``PIL.Image.Image``, without importing Pillow."""
    image_module = sys.modules.get("PIL.Image")
    return image_module is not None and isinstance(value, image_module.Image)


_SCALARS = (str, bytes, bool, int, float)
# Media and options deeper than this are refused: no real media nests this deep, and
# walking deeper (here, in vLLM's hasher, in pickling) would run out of stack.
MAX_DEPTH: Final = 32


def check_text(path: str, text: str) -> str:
    """``text`` when it encodes as UTF-8 (as every key does), else a clear error.

    A lone surrogate is a valid ``str`` that no key can hash; found here, it names its
    field, where the engine would raise a bare ``UnicodeEncodeError``.
    """
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise InvalidPromptError(
                path,
                f"contains a lone surrogate {text[error.start]!r} at index {error.start}, "
                "which has no UTF-8 encoding to hash",
            ) from None
    return text


def is_immutable_array(array: np.ndarray[Any, Any]) -> bool:
    """True when no public operation can change ``array``'s bytes.

    That is: it and every array it views are read-only, and under them is a ``bytes``
    object. numpy refuses to make such an array writable again, whoever holds it. An
    array that owns its memory may be made writable by anyone holding it or a view of it
    (``view.base``), whatever its flags say now.
    """
    while not array.flags.writeable:
        base: object = array.base
        if isinstance(base, np.ndarray):
            array = base
            continue
        if isinstance(base, memoryview):
            return base.readonly and type(base.obj) is bytes
        return type(base) is bytes
    return False


def immutable_array(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``array`` when :func:`is_immutable_array`, else a copy of it backed by ``bytes``.

    The copy is a plain C-ordered ``ndarray`` of the same dtype and shape (a subclass,
    such as a masked array, gives its data): vLLM keys a non-contiguous array like its
    contiguous copy, so the key is the one the original would have.
    """
    if type(array) is np.ndarray and is_immutable_array(array):
        return array
    plain = np.ascontiguousarray(np.asarray(array))
    data = bytes(plain.reshape(-1).view(np.uint8).data)
    frozen: np.ndarray[Any, Any] = np.frombuffer(data, dtype=plain.dtype, count=plain.size)
    return frozen.reshape(array.shape)


def _exact_scalar(value: object, path: str) -> object:
    """A str, bytes, int or float as exactly that built-in type, checked.

    Subclasses become their base type's value: the engine's dict then carries what the
    key hashes. Ints must fit in 64 bits (numpy makes an object array of a larger one,
    and vLLM hashes that array's pointer bytes); text must encode as UTF-8.
    """
    if isinstance(value, str):
        return check_text(path, str.__str__(value))
    if isinstance(value, bytes):
        return value if type(value) is bytes else bytes(memoryview(value))
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        exact = int.__int__(value)
        if not -(1 << 63) <= exact < 1 << 64:
            raise InvalidPromptError(path, f"{exact} does not fit in 64 bits, so it has no stable key")
        return exact
    return float.__float__(value)  # type: ignore[arg-type]  # a float: the one type left


def _too_deep(path: str) -> InvalidPromptError:
    return InvalidPromptError(path, f"is nested more than {MAX_DEPTH} levels deep")


def freeze_media(value: object, path: str, depth: int = 0) -> object:
    """Freeze one media item (or part of one); raise on types vLLM cannot hash faithfully.

    Arrays become immutable (:func:`immutable_array`: a copy unless already backed by
    ``bytes``), so a key computed once stays the key of the bytes the engine gets.
    """
    if value is None:
        return None
    if isinstance(value, np.generic):
        if value.dtype.hasobject:
            raise PromptTypeError(path, "numpy object scalars cannot be hashed")
        return value
    if isinstance(value, _SCALARS):
        return _exact_scalar(value, path)
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise PromptTypeError(path, "numpy arrays of dtype object cannot be hashed; use a numeric dtype")
        return immutable_array(value)
    if is_torch_tensor(value):
        _check_hashable_tensor(value, path)
        return value
    if is_pil_image(value):
        return value
    if isinstance(value, memoryview):
        return value.tobytes()
    if depth >= MAX_DEPTH:
        raise _too_deep(path)
    if isinstance(value, tuple):
        return tuple(freeze_media(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))
    if isinstance(value, (list, PVector)):
        return _freeze_sequence(value, path, freeze_media, depth)
    if isinstance(value, Mapping):
        return _freeze_mapping(value, path, freeze_media, depth)
    if is_media_with_bytes(value):  # vLLM's loaded media: keyed by its bytes (see _media_bytes)
        return freeze_media_with_bytes(value, path, freeze_media)
    raise PromptTypeError(
        path,
        f"unsupported media value of type {type_name(value)}; expected an image, array, tensor, "
        "list, tuple, dict, str, bytes or number",
    )


def _check_hashable_tensor(tensor: Any, path: str) -> None:
    # vLLM hashes a bfloat16 tensor through a byte view of tensor.contiguous(). A tensor of
    # one element counts as contiguous whatever its stride, keeps that stride, and the
    # view fails: vLLM has no key for it, so refuse it here, with our error, not torch's.
    if tensor.numel() != 1 or str(tensor.dtype) != "torch.bfloat16":
        return
    try:
        tensor.detach().cpu().contiguous().view((1,)).view(_torch_uint8())
    except RuntimeError:
        raise PromptTypeError(
            path,
            f"a one-element bfloat16 tensor with stride {tuple(tensor.stride())} has no key "
            "(vLLM's hasher cannot view its bytes); pass tensor.clone(memory_format=torch.contiguous_format)",
        ) from None


def _torch_uint8() -> Any:
    return sys.modules["torch"].uint8  # a tensor exists, so torch is imported already


def freeze_option(value: object, path: str, depth: int = 0) -> object:
    """Freeze an option value (processor kwargs, stage payloads): any value, containers frozen.

    Arrays become immutable like media (:func:`immutable_array`); a bytearray or
    memoryview becomes ``bytes`` (a copy): the caller could write through either, and a
    memoryview cannot be pickled. Other objects are kept as given.
    """
    if isinstance(value, np.ndarray):
        return value if value.dtype.hasobject else immutable_array(value)
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, (tuple, list, PVector, Mapping)) and depth >= MAX_DEPTH:
        raise _too_deep(path)
    if isinstance(value, tuple):
        return tuple(freeze_option(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))
    if isinstance(value, (list, PVector)):
        return _freeze_sequence(value, path, freeze_option, depth)
    if isinstance(value, Mapping):
        return _freeze_mapping(value, path, freeze_option, depth)
    return value


def _freeze_sequence(value: Any, path: str, freeze: Any, depth: int) -> PVector[Any]:
    frozen = [freeze(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, PVector) and all(a is b for a, b in zip(frozen, value, strict=True)):
        return value
    return pvector(frozen)


def _freeze_mapping(value: Mapping[Any, Any], path: str, freeze: Any, depth: int) -> FrozenDict[str, Any]:
    frozen: dict[str, Any] = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise PromptTypeError(f"{path}", f"mapping keys must be str, got {type_name(key)} {key!r}")
        name = check_text(path, str.__str__(key))
        frozen[name] = freeze(item, f"{path}.{name}", depth + 1)
    if isinstance(value, FrozenDict) and all(frozen[k] is value[k] for k in frozen):
        return value
    return FrozenDict(frozen)


def thaw(value: object) -> Any:
    """The plain shape vLLM expects: lists, dicts and tuples; arrays stay read-only views."""
    if isinstance(value, PVector):
        return [thaw(v) for v in value]
    if isinstance(value, (FrozenDict, PMap)):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(thaw(v) for v in value)
    return value


# The maps records built, by identity, each with a plain dict of its items in the order
# the caller gave them. Records store PMaps, but iterating or indexing a PMap runs Python
# code (about 0.3-0.8 us a time) and scoped copies of a template share its maps, so the
# render path reads this dict instead. Being here also means "checked and frozen": a record
# given another record's map takes it as is. An entry leaves with its map.
class _MapRef(weakref.ref):  # type: ignore[type-arg]
    """A weak reference that knows its entry's key: one shared callback, no closure each."""

    __slots__ = ("key",)
    key: int


def _drop_map(ref: _MapRef) -> None:
    entry = _FROZEN_MAPS.get(ref.key)
    if entry is not None and entry[0] is ref:
        del _FROZEN_MAPS[ref.key]


_FROZEN_MAPS: dict[int, tuple[_MapRef, dict[Any, Any]]] = {}


def frozen_map(items: dict[_K, _V]) -> PMap[_K, _V]:
    """A PMap of ``items`` (already checked and frozen), registered with ``items`` as its plain view.

    ``items`` is kept, so the caller must not change it afterwards.
    """
    value: PMap[_K, _V] = pmap(items)
    key = id(value)
    entry = _FROZEN_MAPS.get(key)
    if entry is None or entry[0]() is not value:
        ref = _MapRef(value, _drop_map)
        ref.key = key
        # The callback runs before the map's memory (and so its id) can be reused.
        _FROZEN_MAPS[key] = (ref, items)
    return value


def is_frozen_map(value: object) -> bool:
    """True for a map :func:`frozen_map` built (so already checked and frozen)."""
    entry = _FROZEN_MAPS.get(id(value))
    return entry is not None and entry[0]() is value


def plain_map(value: PMap[_K, _V]) -> Mapping[_K, _V]:
    """``value``'s items as a plain ``dict``, in the order the record was given them. Read only."""
    entry = _FROZEN_MAPS.get(id(value))
    if entry is not None and entry[0]() is value:
        return entry[1]
    return dict(value.items())  # not a record's map: read it, without keeping a copy


def immutable_token(value: object, leaves: list[object]) -> object | None:
    """A hashable stand-in for a frozen item whose bytes can never change, or None.

    Equal tokens mean equal keys: a token tells apart at least what the hash does
    (``0.0`` from ``-0.0``; numpy scalars by their pickle, as vLLM hashes them). Only
    exact built-in types count; arrays only when :func:`is_immutable_array`, by identity,
    collected in ``leaves`` so a cache can drop the entry when one dies. Tensors and PIL
    images can be changed by whoever holds them: never cached.
    """
    kind = type(value)
    if value is None or kind is str or kind is bytes or kind is int or kind is bool:
        return (kind, value)
    if kind is float:
        return (kind, struct.pack("<d", value))
    if kind is np.ndarray:
        if not is_immutable_array(value):  # type: ignore[arg-type]
            return None
        leaves.append(value)
        return ("ndarray", id(value))
    if isinstance(value, np.generic):
        return ("generic", pickle.dumps(value))
    if kind is tuple or isinstance(value, PVector):
        parts = []
        for item in value:  # type: ignore[attr-defined]
            token = immutable_token(item, leaves)
            if token is None:
                return None
            parts.append(token)
        return (kind.__name__, tuple(parts))
    if kind is FrozenDict:
        parts = []
        for key, item in value.items():  # type: ignore[attr-defined]
            token = immutable_token(item, leaves)
            if token is None or type(key) is not str:
                return None
            parts.append((key, token))
        return ("map", tuple(parts))
    return None
