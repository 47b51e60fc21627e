"""vLLM's ``MediaWithBytes``: a decoded item together with the encoded bytes it came from.

vLLM's ``MediaConnector`` and its chat parser hand media over wrapped this way, and its
hasher keys such an item by the original bytes (plus the decode settings that changed
the item, ``io_config``), not by its pixels: the server's key for an uploaded PNG is a
hash of the PNG file. The core never imports vLLM, so the type is recognised by its
shape: a dataclass named ``MediaWithBytes`` with the fields ``media`` and
``original_bytes``.

A record stores a frozen copy: an instance of a subclass of the caller's class (so
vLLM's own ``isinstance`` checks still pass when ``to_vllm`` hands it over) whose fields
cannot be reassigned, holding the item frozen like any other media. A video wrapped with
its metadata, ``MediaWithBytes((frames, metadata), data)`` as vLLM's video loader returns
it, is stored the way vLLM's parser splits it before hashing and processing:
``(MediaWithBytes(frames, data), metadata)``, or the wrapper alone where the metadata is
``None``. The engine then keys and processes the record's item exactly as it would the
loader's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any, Final

from ._errors import PromptTypeError, type_name

__all__ = ["feed_media_with_bytes", "freeze_media_with_bytes", "is_media_with_bytes"]

_Update = Callable[[Any], object]
_Freeze = Callable[[object, str], object]

# A class attribute of the frozen subclasses, so they are told apart from vLLM's own.
_FROZEN_MARK: Final = "_omni_requests_frozen"


def is_media_with_bytes(value: object) -> bool:
    """True for vLLM's ``MediaWithBytes`` (any version that has its two fields), no import needed."""
    cls = type(value)
    if cls.__name__ != "MediaWithBytes":
        return False
    fields = getattr(cls, "__dataclass_fields__", None)
    # vLLM's is a plain dataclass: a slotted look-alike (no __dict__) is not it.
    return (
        isinstance(fields, dict)
        and "media" in fields
        and "original_bytes" in fields
        and hasattr(value, "__dict__")
    )


def _is_pil_image(value: object) -> bool:
    from ._media import is_pil_image

    return is_pil_image(value)


def _is_frames(value: object) -> bool:
    from ._media import MediaKind, media_kind

    return media_kind(value) in (MediaKind.ARRAY, MediaKind.TENSOR)


def freeze_media_with_bytes(value: Any, path: str, freeze: _Freeze) -> object:
    """The frozen form of a ``MediaWithBytes`` (see the module's docs); refuses what vLLM cannot key.

    ``freeze`` freezes the wrapped item (the records' own ``freeze_media``).
    """
    if getattr(type(value), _FROZEN_MARK, False):
        return value
    cls = type(value)
    media = value.__dict__.get("media")
    original = value.__dict__.get("original_bytes")
    io_config = value.__dict__.get("io_config") if "io_config" in cls.__dataclass_fields__ else None
    if isinstance(original, memoryview):
        original = original.tobytes()  # vLLM hashes a memoryview like its bytes
    if type(original) is not bytes:
        raise PromptTypeError(
            f"{path}.original_bytes", f"must be bytes (vLLM pickles anything else), got {type_name(original)}"
        )
    if io_config is not None and not isinstance(io_config, Mapping):
        raise PromptTypeError(f"{path}.io_config", f"must be a mapping or None, got {type_name(io_config)}")
    if isinstance(media, tuple) and len(media) == 2 and _is_frames(media[0]):
        # vLLM's video parser splits (frames, metadata) out of the wrapper, keeping the
        # bytes with the frames and dropping io_config; it hashes and processes that.
        frames, metadata = media
        if metadata is not None and not isinstance(metadata, Mapping):
            raise PromptTypeError(
                f"{path}.media[1]", f"video metadata must be a mapping or None, got {type_name(metadata)}"
            )
        inner = _frozen(cls, freeze(frames, f"{path}.media[0]"), original, None)
        if metadata is None:
            return inner
        return (inner, freeze(metadata, f"{path}.media[1]"))
    if not (_is_pil_image(media) or _is_frames(media)):
        raise PromptTypeError(
            f"{path}.media",
            f"vLLM keys a MediaWithBytes holding a PIL image, an array or tensor of frames, or "
            f"(frames, metadata); it pickles anything else, got {type_name(media)}",
        )
    frozen_config = None if io_config is None else freeze(io_config, f"{path}.io_config")
    return _frozen(cls, freeze(media, f"{path}.media"), original, frozen_config)


# -- the frozen subclass, one per vLLM class --

_CLASSES: dict[type, type] = {}
_CLASSES_LOCK = threading.Lock()


def _frozen(cls: type, media: object, original: bytes, io_config: object) -> Any:
    frozen_cls = _CLASSES.get(cls)
    if frozen_cls is None:
        with _CLASSES_LOCK:
            frozen_cls = _CLASSES.get(cls)
            if frozen_cls is None:
                frozen_cls = _CLASSES[cls] = _frozen_class(cls)
    item: Any = object.__new__(frozen_cls)
    state = item.__dict__
    state["_media"], state["_original"], state["_io_config"] = media, original, io_config
    return item


def _thaw(value: object) -> Any:
    from ._media import thaw

    return thaw(value)


def _media(self: Any) -> Any:
    return _thaw(self.__dict__["_media"])


def _original_bytes(self: Any) -> bytes:
    original: bytes = self.__dict__["_original"]
    return original


def _io_config(self: Any) -> Any:
    config = self.__dict__["_io_config"]
    return None if config is None else _thaw(config)  # a new dict each time: nobody shares it


def _refuse_write(self: Any, name: str, value: object = None) -> None:
    raise AttributeError(f"a record's MediaWithBytes is frozen; cannot change {name!r}")


def _eq(self: Any, other: object) -> bool:
    if not is_media_with_bytes(other):
        return NotImplemented  # type: ignore[no-any-return]
    from ._records import values_equal

    other_any: Any = other
    return bool(
        self.original_bytes == other_any.original_bytes
        and self.io_config == getattr(other_any, "io_config", None)
        and values_equal(self.__dict__["_media"], other_any.media)
    )


def _hash(self: Any) -> int:
    return hash(self.__dict__["_original"])


def _repr(self: Any) -> str:
    from ._records import _summary

    config = "" if self.__dict__["_io_config"] is None else f", io_config={self.io_config!r}"
    return f"MediaWithBytes({_summary(self.__dict__['_media'])}, {len(self.original_bytes)} bytes{config})"


def _rebuild(cls: type, media: object, original: bytes, io_config: object) -> object:
    from ._media import freeze_media

    value: Any = object.__new__(cls)
    value.__dict__.update(media=media, original_bytes=original, io_config=io_config)
    return freeze_media_with_bytes(value, "$", freeze_media)


def _reduce(self: Any) -> tuple[Any, ...]:
    # Pickled as vLLM's own class plus the values, and frozen again when loaded. Arrays go
    # as the records' own pickle form: numpy's turns big-endian frames native below protocol 5.
    from ._records import pickle_form

    media, config = pickle_form(self.media), pickle_form(self.io_config)
    return (_rebuild, (type(self).__mro__[1], media, self.original_bytes, config))


def _itself(self: Any, memo: object = None) -> Any:
    # Frozen, so a copy may be itself. Without this copy.deepcopy finds vLLM's __getattr__,
    # which hands it the wrapped item's __deepcopy__: the copy was a bare array.
    return self


def _frozen_class(cls: type) -> type:
    namespace = {
        "__doc__": f"A record's frozen {cls.__module__}.{cls.__qualname__}: its fields cannot be reassigned.",
        "__module__": __name__,
        _FROZEN_MARK: True,
        "media": property(_media),
        "original_bytes": property(_original_bytes),
        "io_config": property(_io_config),
        "__setattr__": _refuse_write,
        "__delattr__": _refuse_write,
        "__eq__": _eq,
        "__hash__": _hash,
        "__repr__": _repr,
        "__reduce__": _reduce,
        "__copy__": _itself,
        "__deepcopy__": _itself,
    }
    return type(cls.__name__, (cls,), namespace)


# -- keys: what vLLM's MultiModalHasher feeds for such an item --


def feed_media_with_bytes(update: _Update, value: Any, leaf: Callable[[_Update, object], None]) -> None:
    """Feed ``value`` to ``update`` as vLLM's hasher does, in place of a tagged value.

    A video still wrapped with its metadata is fed as vLLM's parser splits it (see the
    module's docs), so the key is the engine's key for that item.
    """
    from ._hashing import _TAG_LEAF, _TAG_SEQUENCE, _length, _value

    media = value.media
    original = value.original_bytes
    if isinstance(original, memoryview):
        original = original.tobytes()
    if isinstance(media, tuple) and len(media) == 2 and _is_frames(media[0]):
        frames, metadata = media
        if metadata is not None:
            update(_TAG_SEQUENCE)
            update(_length(2))
        update(_TAG_LEAF)
        _feed_leaf(update, frames, original, None, leaf)
        if metadata is not None:
            _value(update, metadata, leaf)
        return
    update(_TAG_LEAF)
    io_config = value.io_config if "io_config" in type(value).__dataclass_fields__ else None
    _feed_leaf(update, media, original, io_config, leaf)


def _feed_leaf(
    update: _Update, media: Any, original: object, io_config: object, leaf: Callable[[_Update, object], None]
) -> None:
    from ._hashing import _exif_image_id, _framed, _leaf, _named

    if _is_pil_image(media):
        # By its EXIF ImageID only on vLLM's own road (its hasher's key under image): a
        # content key outside image and a fingerprint read the bytes, as for a bare image.
        image_id = _exif_image_id(media) if leaf is _leaf else None
        if image_id is not None:
            _framed(update, image_id)
        elif io_config:
            _named(update, "image", {"io_config": io_config, "data": original}, leaf)
        else:
            _named(update, "image", original, leaf)
        return
    if _is_frames(media):
        # vLLM keys the frames themselves when they are smaller than the encoded bytes.
        if isinstance(original, bytes) and media.nbytes < len(original):
            _named(update, "video", media, leaf)
        else:
            _named(update, "video", original, leaf)
        return
    raise PromptTypeError(
        "item.media",
        f"vLLM pickles a MediaWithBytes holding {type_name(media)}, so it has no stable key",
    )
