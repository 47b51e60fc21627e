"""A safe, versioned wire format for prompt records: msgpack bytes, through msgspec.

Records move between processes and hosts (an API server, a router, engine cores). A
pickle of a record is unsafe across a trust boundary; this format is not. :func:`encode`
turns any record into bytes and :func:`decode` turns them back into an equal record in
another process, with the same ``to_vllm`` dict and the same keys: every field, the
caller's modality order, user UUIDs, and the scope (stage, replica, hasher, policy).

>>> import numpy as np
>>> from omni_requests import TextPrompt
>>> from omni_requests.wire import decode, encode
>>> video = np.zeros((8, 32, 32, 3), np.uint8)
>>> record = TextPrompt(prompt="<video> Describe it.", multi_modal_data={"video": video})
>>> decode(encode(record)) == record
True

Media payloads travel as raw bytes (msgpack ``bin``), with no per-element work: an array
is its dtype string, shape and C-order bytes, and decodes as a read-only array backed by
``bytes``; a tensor is its dtype name, shape and bytes (decoding one needs torch); a PIL
image is what its key reads (mode, size, pixels, palette, transparency, EXIF ImageID and
Orientation). Tuples stay tuples (vLLM reads ``(audio, rate)`` apart from ``[a, b]``).

Decoding is safe on untrusted bytes: no pickle, no imports named by the input, sizes and
nesting bounded (``max_bytes``, ``max_depth``), and every value passes through the
records' own constructors, so every check a record makes runs. Whatever the input, the
result is a record or an :class:`~omni_requests.OmniRequestsError`: :class:`WireError`
for bytes that are not a message of this format, the records' own errors (naming the
field path) for a message whose values a record refuses.

This module needs msgspec (``pip install 'omni-requests[wire]'``); ``import
omni_requests`` does not import it.
"""

from __future__ import annotations

import numbers
import re
import uuid
from typing import Any, Final

import attrs
import msgspec
import numpy as np
from pyrsistent import PVector, pvector

from . import (
    EmbedsPrompt,
    EncoderDecoderPrompt,
    FrozenDict,
    InvalidPromptError,
    KeyPolicy,
    MediaHasher,
    OmniRequestsError,
    Prompt,
    PromptTypeError,
    Scope,
    TextPrompt,
    TokensPrompt,
    __version__,
)
from ._errors import Fault
from ._exif import EXIF_IMAGE_ID, EXIF_ORIENTATION, readable_tags
from ._hashing import vllm_turn
from ._media import (  # the caller's modality order: a PMap iterates in its own
    IMAGE_MODES,
    PALETTE_MODES,
    PALETTE_RAWMODES,
    apply_palette_state,
    beyond_unicode,
    beyond_unicode_message,
    frozen_array,
    handout,
    is_pil_image,
    is_torch_tensor,
    palette_state,
    plain_map,
)
from ._media_bytes import is_media_with_bytes
from ._sealed import current, torch_as_is

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_DEPTH",
    "WIRE_VERSION",
    "WireError",
    "WireVersionError",
    "decode",
    "encode",
]

WIRE_VERSION: Final = 1
"""The version :func:`encode` writes and the only one :func:`decode` reads."""

DEFAULT_MAX_BYTES: Final = 2 << 30
"""The largest message :func:`decode` takes by default (2 GiB); pass ``max_bytes`` for more."""

DEFAULT_MAX_DEPTH: Final = 32
"""How deeply values may nest inside a record field by default (lists, tuples, dicts)."""

_MAGIC: Final = "omni-requests"


class WireError(OmniRequestsError, ValueError):
    """Bytes that are not a valid message of this format (truncated, malformed, too big)."""


class WireVersionError(WireError):
    """A message of another version of this format."""


# A tagged value is a msgpack array whose first element is an empty Ext of its tag. No
# value a record holds encodes to an Ext, so a plain list never starts with one.
_RECORD, _SCOPE, _TUPLE, _ARRAY, _SCALAR, _TENSOR, _IMAGE, _BIGINT = range(1, 9)
_TAGS: Final = {code: msgspec.msgpack.Ext(code, b"") for code in range(1, 9)}

_KINDS: Final[dict[type[Any], str]] = {
    TextPrompt: "text",
    TokensPrompt: "tokens",
    EmbedsPrompt: "embeds",
    EncoderDecoderPrompt: "encoder_decoder",
}
_CLASSES: Final = {name: kind for kind, name in _KINDS.items()}
_FIELDS: Final = {kind: frozenset(f.name for f in attrs.fields(kind)) for kind in _KINDS}
_RECORD_FIELDS: Final = frozenset({"encoder_prompt", "decoder_prompt"})

# dtype.str of a plain numpy dtype: byte order, kind, item size, a unit for datetimes.
_DTYPE: Final = re.compile(r"[<>|][biufcmMSUV][0-9]{1,5}(\[[0-9]*[A-Za-z]{1,3}\])?")
_MAX_DIMS: Final = 32
_TORCH_DTYPES: Final = frozenset(
    {
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex64",
        "complex128",
        "bool",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "int8",
        "int16",
        "int32",
        "int64",
    }
)
_IMAGE_MODES: Final = frozenset(IMAGE_MODES)
_MAX_SIDE: Final = 1 << 24
_ENCODER: Final = msgspec.msgpack.Encoder()
_HEADER: Final = msgspec.msgpack.Decoder(list[msgspec.Raw])
# Errors numpy, Pillow, torch and msgspec raise on values they refuse; each becomes a WireError.
_REFUSALS: Final = (
    msgspec.DecodeError,
    ValueError,
    TypeError,
    OverflowError,
    MemoryError,
    RecursionError,
    IndexError,
    KeyError,
    RuntimeError,
)


def encode(record: Prompt) -> bytes:
    """``record`` as msgpack bytes of this format's :data:`WIRE_VERSION`.

    Raises :class:`~omni_requests.PromptTypeError`, naming the field path, for a value
    the format has no form for (an option holding an arbitrary object, a structured
    array). Media is copied once, into the message.
    """
    return _ENCODER.encode([_MAGIC, WIRE_VERSION, _record_tree(record, "$")])


def decode(
    data: bytes | bytearray | memoryview,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_depth: int = DEFAULT_MAX_DEPTH,
) -> Prompt:
    """The record :func:`encode` wrote into ``data``, built through its constructor.

    Raises :class:`WireError` (:class:`WireVersionError` for another version) for bytes
    that are not such a message, and the records' own errors for values they refuse;
    nothing else. Messages over ``max_bytes`` are refused before they are read, images
    whose decoded pixels take more than ``max_bytes`` together (a mode ``1`` pixel is a
    bit in the message, a byte decoded), and values nested deeper than ``max_depth``.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PromptTypeError("$", f"must be bytes, got {type(data).__qualname__}")
    for name, limit in (("max_bytes", max_bytes), ("max_depth", max_depth)):
        # Any real number but a bool or NaN (math.inf: no limit), compared as it is.
        if isinstance(limit, (bool, np.bool_)) or not isinstance(limit, numbers.Real) or limit != limit:
            raise PromptTypeError(name, f"must be a number, got {limit!r} ({type(limit).__qualname__})")
    try:
        view = memoryview(data)
    except ValueError:  # a memoryview released by its holder
        raise PromptTypeError("$", "must be bytes, got a released memoryview") from None
    size = view.nbytes
    if size > max_bytes:
        raise WireError("$", f"the message is {size} bytes, over max_bytes={max_bytes}")
    if not view.c_contiguous:  # a strided view (a numpy slice's): read as its bytes in order
        data = view.tobytes()
    try:
        header = _HEADER.decode(data)
        if len(header) < 2:
            raise WireError("$", "not an omni-requests wire message")
        magic, version = msgspec.msgpack.decode(header[0]), msgspec.msgpack.decode(header[1])
    except OmniRequestsError:
        raise
    except _REFUSALS:
        raise WireError("$", "not an omni-requests wire message") from None
    if magic != _MAGIC:
        raise WireError("$", "not an omni-requests wire message")
    if version != WIRE_VERSION or type(version) is not int:
        raise WireVersionError(
            "$",
            f"the message is in wire format version {version!r}; omni-requests {__version__} "
            f"reads version {WIRE_VERSION} only",
        )
    if len(header) != 3:
        raise WireError("$", f"a version {WIRE_VERSION} message has 3 parts, this one {len(header)}")
    try:
        tree = msgspec.msgpack.decode(header[2])
        _RepeatedKeys(header[2]).check()
        record: Prompt = _Reader(max_depth, max_bytes).record(tree, "$", 0)
        return record
    except OmniRequestsError:
        raise
    except _REFUSALS as error:
        raise WireError("$", f"malformed message ({type(error).__name__}: {error})") from None


# -- writing -------------------------------------------------------------------------


def _record_tree(record: Any, path: str) -> list[Any]:
    kind = _KINDS.get(type(record))
    if kind is None:
        raise PromptTypeError(
            path,
            f"must be a TextPrompt, TokensPrompt, EmbedsPrompt or EncoderDecoderPrompt, got {_name(record)}",
        )
    fields: dict[str, Any] = {}
    for field in attrs.fields(type(record)):
        name = field.name
        value = getattr(record, name)
        where = f"{path}.{name}"
        if value is None:
            continue
        if name == "multi_modal_data":
            if value:
                fields[name] = [
                    [m, [_value_tree(item, f"{where}.{m}[{i}]") for i, item in enumerate(items)]]
                    for m, items in plain_map(value).items()
                ]
        elif name == "multi_modal_uuids":
            if value:
                fields[name] = [[m, list(uuids)] for m, uuids in plain_map(value).items()]
        elif name == "scope":
            fields[name] = _scope_tree(value)
        elif name in _RECORD_FIELDS:
            fields[name] = _record_tree(value, where)
        else:
            fields[name] = _value_tree(value, where)
    return [_TAGS[_RECORD], kind, fields]


def _scope_tree(scope: Scope) -> list[Any]:
    policy = scope.policy
    return [
        _TAGS[_SCOPE],
        scope.stage_id,
        scope.replica_id,
        scope.hasher.model_id,
        scope.hasher.algorithm,
        policy.namespaces,
        policy.tenant,
        policy.tenant_content,
        policy.bind_content,
    ]


def _value_tree(value: Any, path: str) -> Any:
    kind = type(value)
    if value is None or kind is bool or kind is str or kind is bytes or kind is float:
        return value
    if kind is int:
        return value if -(1 << 63) <= value < 1 << 64 else [_TAGS[_BIGINT], str(value)]
    if kind is list or isinstance(value, PVector):
        return [_value_tree(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if kind is tuple:
        return [_TAGS[_TUPLE], *(_value_tree(v, f"{path}[{i}]") for i, v in enumerate(value))]
    if kind is dict or kind is FrozenDict:
        out = {}
        for key, item in value.items():
            if type(key) is not str:
                raise PromptTypeError(path, f"mapping keys must be str to go on the wire, got {_name(key)}")
            out[key] = _value_tree(item, f"{path}.{key}")
        return out
    if kind is np.ndarray:
        return _array_tree(handout(value), path)  # a record's array: as made, what it keys
    if isinstance(value, np.generic):
        dtype = _wire_dtype(value.dtype, path)
        return [_TAGS[_SCALAR], dtype.str, value.tobytes()]
    if is_torch_tensor(value):
        return _tensor_tree(current(value), path)  # a record's view: the bytes it sealed
    if is_pil_image(value):
        return _image_tree(current(value), path)
    if is_media_with_bytes(value):
        raise PromptTypeError(
            path,
            "vLLM's MediaWithBytes (an item loaded from its encoded bytes, keyed by those bytes) has no "
            "wire form; send the encoded bytes and load them where the record is built",
        )
    raise PromptTypeError(
        path,
        f"{_name(value)} has no wire form; values may be None, bool, int, float, str, bytes, lists, "
        "tuples, dicts with str keys, numpy arrays and scalars, torch tensors and PIL images",
    )


def _wire_dtype(dtype: np.dtype[Any], path: str) -> np.dtype[Any]:
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None or dtype.itemsize == 0:
        raise PromptTypeError(path, f"a numpy dtype {dtype!s} has no wire form; use a plain numeric dtype")
    return dtype


def _array_tree(array: np.ndarray[Any, Any], path: str) -> list[Any]:
    dtype = _wire_dtype(array.dtype, path)
    contiguous = array if array.flags.c_contiguous else np.ascontiguousarray(array)
    raw = contiguous.reshape(-1).view(np.uint8).data  # a memoryview; no copy for a C-order array
    return [_TAGS[_ARRAY], dtype.str, list(array.shape), raw]


def _tensor_tree(tensor: Any, path: str) -> list[Any]:
    import torch  # a tensor exists, so torch is imported already

    name = str(tensor.dtype).removeprefix("torch.")
    if name not in _TORCH_DTYPES or tensor.layout != torch.strided or tensor.is_quantized:
        raise PromptTypeError(path, f"a {tensor.layout} tensor of {tensor.dtype} has no wire form")
    with torch_as_is(tensor):  # its bytes, whatever torch mode the caller is in
        flat = tensor.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
        raw = memoryview(flat.view(torch.uint8).numpy())
    return [_TAGS[_TENSOR], name, list(tensor.shape), raw]


def _image_tree(image: Any, path: str) -> list[Any]:
    mode = image.mode
    if mode not in _IMAGE_MODES:
        raise PromptTypeError(path, f"a PIL image of mode {mode!r} has no wire form")
    pixels = image.tobytes()  # first, as any reader of the pixels: Pillow realizes a pending palette
    colors = palette_state(image)
    extras: dict[str, Any] = {}
    if "transparency" in image.info:
        extras["transparency"] = _value_tree(image.info["transparency"], f"{path}.info.transparency")
    tags = readable_tags(image)  # malformed EXIF: vLLM and our hasher ignore it too
    image_id = None if isinstance(tags, Fault) else tags.get(EXIF_IMAGE_ID)
    if isinstance(image_id, uuid.UUID):
        extras["image_uuid"] = image_id.bytes
    elif type(image_id) in (str, bytes):
        extras["image_id"] = image_id  # vLLM ignores it, but equal records keep it
    turn = vllm_turn(image)
    if turn is not None:  # only the turn vLLM's parser makes: what the receiver's image must make
        extras["orientation"] = turn
    return [_TAGS[_IMAGE], mode, image.size[0], image.size[1], pixels, colors, extras]


def _name(value: object) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


# -- reading -------------------------------------------------------------------------

# Decoded scopes are kept, so records decoded for one replica share their scope (and
# whatever rendering of it is cached). Bounded like scope_to_replica's.
_SCOPES: dict[tuple[Any, ...], Scope] = {}
_MAX_SCOPES: Final = 4096


def _is_tag(value: object, code: int) -> bool:
    return type(value) is msgspec.msgpack.Ext and value.code == code


def _nested_path(path: str, error: OmniRequestsError) -> OmniRequestsError:
    """``error`` (from a constructor, rooted at ``$``) with its path under ``path``."""
    if path == "$":
        return error
    return error.under(path)


@attrs.define
class _Reader:
    max_depth: int
    max_bytes: int
    pixels: int = 0
    """Bytes of pixels the message's images take once decoded, so far."""

    def record(self, tree: object, path: str, depth: int) -> Any:
        if not (type(tree) is list and len(tree) == 3 and _is_tag(tree[0], _RECORD)):
            raise WireError(path, "expected a record")
        _, kind, fields = tree
        cls = _CLASSES.get(kind) if type(kind) is str else None
        if cls is None:
            raise WireError(path, f"unknown record kind {kind!r}")
        if type(fields) is not dict:
            raise WireError(path, "a record's fields must be a map")
        names = _FIELDS[cls]
        kwargs: dict[str, Any] = {}
        for name, value in fields.items():
            if type(name) is not str or name not in names:
                raise InvalidPromptError(f"{path}.{name}", f"is not a field of {cls.__name__}")
            where = f"{path}.{name}"
            if name in _RECORD_FIELDS:
                if depth >= 1:
                    raise WireError(where, "records nest one level deep at most")
                kwargs[name] = None if value is None else self.record(value, where, depth + 1)
            elif name == "scope":
                kwargs[name] = self.scope(value, where)
            elif name == "multi_modal_data":
                kwargs[name] = {m: pvector(items) for m, items in self.rows(value, where, media=True)}
            elif name == "multi_modal_uuids":
                kwargs[name] = dict(self.rows(value, where, media=False))
            else:
                kwargs[name] = self.value(value, where, 0)
        try:
            return cls(**kwargs)
        except OmniRequestsError as error:
            raise _nested_path(path, error) from None
        except TypeError as error:  # a required field is missing: attrs' own TypeError
            raise WireError(path, f"{cls.__name__}: {error}") from None

    def rows(self, tree: object, path: str, *, media: bool) -> list[tuple[str, list[Any]]]:
        """A media map's (modality, items) rows, in the order they were written."""
        if type(tree) is not list:
            raise WireError(path, "expected a list of [modality, items] rows")
        rows: list[tuple[str, list[Any]]] = []
        seen: set[str] = set()
        for i, row in enumerate(tree):
            if not (type(row) is list and len(row) == 2 and type(row[0]) is str and type(row[1]) is list):
                raise WireError(f"{path}[{i}]", "expected a [modality, items] row")
            modality, items = row
            if modality in seen:
                raise InvalidPromptError(f"{path}.{modality}", "appears twice")
            seen.add(modality)
            where = f"{path}.{modality}"
            if media:
                items = [self.value(item, f"{where}[{j}]", 0) for j, item in enumerate(items)]
            rows.append((modality, items))  # UUIDs: checked by the constructor
        return rows

    def scope(self, tree: object, path: str) -> Scope:
        if not (type(tree) is list and len(tree) == 9 and _is_tag(tree[0], _SCOPE)):
            raise WireError(path, "expected a scope")
        parts = tuple(tree[1:])
        # Types first: a key of unhashable parts cannot be looked up.
        if not all(part is None or type(part) in (bool, int, str) for part in parts):
            raise WireError(path, "a scope holds ints, strs and bools only")
        key = tuple((type(part), part) for part in parts)
        scope = _SCOPES.get(key)
        if scope is not None:
            return scope
        stage, replica, model_id, algorithm, namespaces, tenant, tenant_content, bind_content = parts
        try:
            hasher = MediaHasher(model_id, algorithm)
            policy = KeyPolicy(namespaces, tenant, tenant_content, bind_content)
            scope = Scope(stage, replica, hasher, policy)
        except OmniRequestsError as error:
            raise _nested_path(path, error) from None
        if len(_SCOPES) >= _MAX_SCOPES:
            _SCOPES.clear()
        _SCOPES[key] = scope
        return scope

    def value(self, tree: object, path: str, depth: int) -> Any:
        if depth > self.max_depth:
            raise WireError(path, f"values nest deeper than max_depth={self.max_depth}")
        kind = type(tree)
        if tree is None or kind in (bool, int, float, str, bytes):
            return tree
        if kind is dict:
            out = {}
            for key, item in tree.items():  # type: ignore[attr-defined]
                if type(key) is not str:
                    raise WireError(path, f"map keys must be str, got {_name(key)}")
                out[key] = self.value(item, f"{path}.{key}", depth + 1)
            return out
        if kind is list:
            items: list[Any] = tree  # type: ignore[assignment]
            if items and type(items[0]) is msgspec.msgpack.Ext:
                return self.tagged(items, path, depth)
            return [self.value(item, f"{path}[{i}]", depth + 1) for i, item in enumerate(items)]
        raise WireError(path, f"unexpected {_name(tree)}")

    def tagged(self, tree: list[Any], path: str, depth: int) -> Any:
        tag: msgspec.msgpack.Ext = tree[0]
        if tag.data:
            raise WireError(path, "malformed tag")
        code, args = tag.code, tree[1:]
        if code == _TUPLE:
            return tuple(self.value(item, f"{path}[{i}]", depth + 1) for i, item in enumerate(args))
        if code == _ARRAY and _shaped(args, path):
            text, shape, raw = args
            dtype = _read_dtype(text, path)
            _check_array_size(dtype, shape, raw, path)
            # Over bytes only the decoder made: a record takes it without a copy.
            return _text_checked(frozen_array(raw, dtype, tuple(shape)), path)
        if code == _SCALAR and len(args) == 2 and type(args[1]) is bytes:
            dtype = _read_dtype(args[0], path)
            if len(args[1]) != dtype.itemsize:
                raise WireError(path, f"a {dtype} scalar has {dtype.itemsize} bytes, not {len(args[1])}")
            return _text_checked(np.frombuffer(args[1], dtype).reshape(()), path)[()]
        if code == _TENSOR and _shaped(args, path):
            return _read_tensor(*args, path=path)
        if code == _IMAGE:
            return self.image(args, path, depth)
        if code == _BIGINT and len(args) == 1 and type(args[0]) is str and len(args[0]) <= 4300:
            if re.fullmatch(r"-?[0-9]+", args[0]) is None:
                raise WireError(path, "malformed big int")
            return int(args[0])
        raise WireError(path, f"malformed value with tag {code}")

    def palette(self, image: Any, colors: object, path: str) -> None:
        modes = PALETTE_MODES
        if type(colors) is not list or len(colors) != 4:
            raise WireError(path, "malformed palette")
        palette_mode, rawmode, data, core = colors
        if palette_mode is None:  # a P image converted by its core's palette alone
            well_formed = rawmode is None and data is None and core is not None
        else:
            well_formed = (
                palette_mode in modes
                and (rawmode is None or rawmode in PALETTE_RAWMODES)
                and type(data) is bytes
                and len(data) <= 4 * 256
            )
        if not well_formed:
            raise WireError(path, "malformed palette")
        if core is not None and not (
            image.mode in ("P", "PA")
            and type(core) is list
            and len(core) == 2
            and core[0] in modes
            and type(core[1]) is bytes
            and len(core[1]) <= 4 * 256
            and len(core[1]) % len(core[0]) == 0
        ):
            raise WireError(path, "malformed palette")
        apply_palette_state(image, colors)  # type: ignore[arg-type]

    def image(self, args: list[Any], path: str, depth: int) -> Any:
        if not (
            len(args) == 6
            and args[0] in _IMAGE_MODES
            and all(type(side) is int and 0 <= side <= _MAX_SIDE for side in args[1:3])
            and type(args[3]) is bytes
            and type(args[5]) is dict
        ):
            raise WireError(path, "malformed image")
        mode, width, height, pixels, colors, extras = args
        try:
            from PIL import Image
        except ImportError:
            raise WireError(path, "a PIL image needs Pillow: pip install 'omni-requests[images]'") from None
        probe = Image.new(mode, (1, 1)).tobytes()
        line = (width + 7) // 8 if mode == "1" else width * len(probe)
        if len(pixels) != line * height:
            raise WireError(
                path, f"a {mode} image of {width}x{height} has {line * height} bytes, not {len(pixels)}"
            )
        # A mode 1 pixel is a bit in the message but a byte once decoded (and keying reads
        # more): counted as decoded, its images cannot make a message 8 times its size.
        self.pixels += width * height * len(probe)
        if self.pixels > self.max_bytes:
            raise WireError(
                path,
                f"the message's images decode to {self.pixels} bytes of pixels, over "
                f"max_bytes={self.max_bytes} (a mode 1 pixel is one bit here, one byte decoded)",
            )
        image = (
            Image.frombytes(mode, (width, height), pixels)
            if width and height
            else Image.new(mode, (width, height))
        )
        if colors is not None:
            self.palette(image, colors, f"{path}.palette")
        unknown = set(extras) - {"transparency", "image_uuid", "image_id", "orientation"}
        if unknown:
            raise WireError(path, f"unknown image fields {sorted(unknown)}")
        if "transparency" in extras:
            image.info["transparency"] = self.value(
                extras["transparency"], f"{path}.info.transparency", depth + 1
            )
        exif = image.getexif() if len(extras.keys() - {"transparency"}) else None
        if exif is not None:
            image_uuid, image_id = extras.get("image_uuid"), extras.get("image_id")
            if image_uuid is not None:
                if type(image_uuid) is not bytes or len(image_uuid) != 16:
                    raise WireError(path, "malformed EXIF ImageID")
                exif[EXIF_IMAGE_ID] = uuid.UUID(bytes=image_uuid)
            elif image_id is not None:
                if type(image_id) not in (str, bytes):
                    raise WireError(path, "malformed EXIF ImageID")
                exif[EXIF_IMAGE_ID] = image_id
            orientation = extras.get("orientation")
            if orientation is not None:
                if type(orientation) is not int:
                    raise WireError(path, "malformed EXIF Orientation")
                exif[EXIF_ORIENTATION] = orientation
        return image


def _shaped(args: list[Any], path: str) -> bool:
    """True for ``[dtype, shape, raw]`` with a well-formed shape; else a WireError."""
    if not (
        len(args) == 3
        and type(args[0]) is str
        and type(args[1]) is list
        and len(args[1]) <= _MAX_DIMS
        and all(type(n) is int and 0 <= n < 1 << 62 for n in args[1])
        and type(args[2]) is bytes
    ):
        raise WireError(path, "malformed array")
    return True


def _read_dtype(text: object, path: str) -> np.dtype[Any]:
    if type(text) is not str or _DTYPE.fullmatch(text) is None:
        raise WireError(path, f"{text!r} is not a plain numpy dtype")
    dtype = np.dtype(text)
    if dtype.str != text or dtype.itemsize == 0 or dtype.hasobject or dtype.fields is not None:
        raise WireError(path, f"{text!r} is not a plain numpy dtype")
    return dtype


def _text_checked(array: np.ndarray[Any, Any], path: str) -> np.ndarray[Any, Any]:
    # numpy raises SystemError reading such text (a scalar as it is made): refused first.
    found = beyond_unicode(array)
    if found is not None:
        raise WireError(path, beyond_unicode_message(array.dtype, *found))
    return array


def _count(shape: list[int]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count


# numpy and torch refuse a shape whose dimensions (the empty ones left out) multiply past
# this, even with no element: an array may span at most an int64's bytes.
_MAX_SPAN: Final = (1 << 63) - 1


def _check_span(shape: list[int], itemsize: int, kind: str, path: str) -> None:
    if _count([n for n in shape if n]) * itemsize > _MAX_SPAN:
        raise WireError(path, f"{kind} of shape {tuple(shape)} is larger than numpy and torch can hold")


def _read_tensor(name: Any, shape: list[int], raw: bytes, *, path: str) -> Any:
    if name not in _TORCH_DTYPES:
        raise WireError(path, f"{name!r} is not a tensor dtype this format carries")
    try:
        import torch
    except ImportError:
        raise WireError(path, "a tensor needs torch: pip install 'omni-requests[torch]'") from None
    dtype = getattr(torch, name)
    # On the CPU, named: an ambient default device (torch.set_default_device, or a
    # `with torch.device(...)` block) would put these on another, or nowhere ("meta").
    itemsize = torch.empty((), dtype=dtype, device="cpu").element_size()
    _check_span(shape, itemsize, f"a {name} tensor", path)
    if _count(shape) * itemsize != len(raw):
        raise WireError(path, f"a {name} tensor of shape {tuple(shape)} has {_count(shape) * itemsize} bytes")
    with torch_as_is():  # the message's bytes, whatever torch mode the caller is in
        flat = torch.empty(len(raw), dtype=torch.uint8, device="cpu")
        flat.numpy()[:] = np.frombuffer(raw, np.uint8)  # tensors own writable memory: one copy
        return flat.view(dtype).reshape(shape)


def _check_array_size(dtype: np.dtype[Any], shape: list[int], raw: bytes, path: str) -> None:
    _check_span(shape, dtype.itemsize, f"an array of {dtype}", path)
    if _count(shape) * dtype.itemsize != len(raw):
        raise WireError(
            path, f"an array of {dtype} and shape {tuple(shape)} has {_count(shape) * dtype.itemsize} bytes"
        )


# -- repeated map keys ----------------------------------------------------------------

# Bytes after the type byte of msgpack's fixed-size values (nil, bools, numbers, fixext).
_FIXED: Final = {
    0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8,
    0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8, 0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17,
}  # fmt: skip
# Bytes of the length after the type byte of a str (first three), bin or ext; an ext's
# code follows its length.
_SIZED: Final = {0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC4: 1, 0xC5: 2, 0xC6: 4, 0xC7: 1, 0xC8: 2, 0xC9: 4}
_STRS: Final = frozenset({0xD9, 0xDA, 0xDB})
_EXTS: Final = frozenset({0xC7, 0xC8, 0xC9})
_IS_MAP, _IS_LIST, _IS_STR, _IS_OTHER = range(4)
_AS_VALUE, _AS_FIELDS, _AS_ROWS, _AS_EXTRAS = range(4)  # what a container is, for its children's paths
_ROW_FIELDS: Final = frozenset({"multi_modal_data", "multi_modal_uuids"})


class _RepeatedKeys:
    """Refuses a map that repeats a key, naming it by the path the reader gives its value.

    msgspec keeps the last of repeated keys, where another reader may keep the first: such
    a message means two things. This walks the message's msgpack (already decoded once, so
    well-formed), skipping strings and buffers by their length.
    """

    __slots__ = ("data",)

    def __init__(self, data: msgspec.Raw) -> None:
        self.data = memoryview(data)

    def check(self) -> None:
        self.walk(0, "$", _AS_VALUE)

    def head(self, pos: int) -> tuple[int, int, int]:
        """What the value at ``pos`` is, its count (a map or list) or its contents' size, and
        where its contents start; a scalar's contents are empty and start at its end."""
        data = self.data
        b = data[pos]
        if b < 0x80 or b >= 0xE0:
            return _IS_OTHER, 0, pos + 1
        if b < 0x90:
            return _IS_MAP, b & 0x0F, pos + 1
        if b < 0xA0:
            return _IS_LIST, b & 0x0F, pos + 1
        if b < 0xC0:
            return _IS_STR, b & 0x1F, pos + 1
        if b in (0xDC, 0xDD, 0xDE, 0xDF):
            width = 2 if b in (0xDC, 0xDE) else 4
            count = int.from_bytes(data[pos + 1 : pos + 1 + width], "big")
            return _IS_LIST if b < 0xDE else _IS_MAP, count, pos + 1 + width
        length = _SIZED.get(b)
        if length is None:
            return _IS_OTHER, 0, pos + 1 + _FIXED[b]
        size = int.from_bytes(data[pos + 1 : pos + 1 + length], "big") + (b in _EXTS)
        return _IS_STR if b in _STRS else _IS_OTHER, size, pos + 1 + length

    def walk(self, pos: int, path: str, role: int) -> int:
        """Check the value at ``pos``, whose path the reader gives as ``path``; where it ends."""
        kind, count, start = self.head(pos)
        if kind == _IS_MAP:
            return self.map(start, count, path, role)
        if kind == _IS_LIST:
            return self.rows(start, count, path) if role == _AS_ROWS else self.list(start, count, path)
        return start + count

    def list(self, pos: int, count: int, path: str) -> int:
        data = self.data
        tag = data[pos + 2] if count and data[pos] == 0xC7 and data[pos + 1] == 0 else None  # an empty Ext
        for i in range(count):
            b = data[pos]
            if b < 0x80 or b >= 0xE0:  # scalars first, with no path made: token ids are lists of ints
                pos += 1
                continue
            fixed = _FIXED.get(b)
            if fixed is not None:
                pos += 1 + fixed
                continue
            if tag is None:
                pos = self.walk(pos, f"{path}[{i}]", _AS_VALUE)
            elif tag == _RECORD and i == 2:
                pos = self.walk(pos, path, _AS_FIELDS)
            elif tag == _TUPLE and i:
                pos = self.walk(pos, f"{path}[{i - 1}]", _AS_VALUE)
            else:
                pos = self.walk(pos, path, _AS_EXTRAS if tag == _IMAGE and i == 6 else _AS_VALUE)
        return pos

    def rows(self, pos: int, count: int, path: str) -> int:
        """Media rows, ``[modality, items]``, whose items' paths are ``path.modality[j]``."""
        for i in range(count):
            kind, size, start = self.head(pos)
            first, length, text = self.head(start) if kind == _IS_LIST and size == 2 else (_IS_OTHER, 0, 0)
            if first != _IS_STR:
                pos = self.walk(pos, f"{path}[{i}]", _AS_VALUE)
                continue
            where = f"{path}.{bytes(self.data[text : text + length]).decode()}"
            kind, size, start = self.head(text + length)
            if kind != _IS_LIST:
                pos = self.walk(text + length, where, _AS_VALUE)
                continue
            pos = start
            for j in range(size):
                pos = self.walk(pos, f"{where}[{j}]", _AS_VALUE)
        return pos

    def map(self, pos: int, count: int, path: str, role: int) -> int:
        seen: set[object] = set()
        for _ in range(count):
            kind, size, start = self.head(pos)
            key: object
            if kind == _IS_STR:
                key, pos = bytes(self.data[start : start + size]).decode(), start + size
            else:  # not a str, which the reader refuses; compared by its bytes
                end = self.walk(pos, path, _AS_VALUE)
                key, pos = bytes(self.data[pos:end]), end
            where, inner = _child(path, role, key)
            if key in seen:
                raise WireError(where, f"the key {key!r} appears twice in one map (a reader may take either)")
            seen.add(key)
            pos = self.walk(pos, where, inner)
        return pos


def _child(path: str, role: int, key: object) -> tuple[str, int]:
    """The path and role the reader gives the value under ``key`` of a map at ``path``."""
    if type(key) is not str:
        return path, _AS_VALUE
    if role == _AS_FIELDS:
        return f"{path}.{key}", _AS_ROWS if key in _ROW_FIELDS else _AS_VALUE
    if role == _AS_EXTRAS:
        return (f"{path}.info.transparency" if key == "transparency" else path), _AS_VALUE
    return f"{path}.{key}", _AS_VALUE
