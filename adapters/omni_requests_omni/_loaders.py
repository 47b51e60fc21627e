"""Loading the media a chat message points at: data URLs and local files, never the network.

A loader is any callable ``(modality, url) -> item``. :class:`DefaultLoader` reads base64
``data:`` URLs and ``file://`` URLs under an allowed folder. Where vLLM is installed it
decodes with vLLM's own media IO (``ImageMediaIO``, ``VideoMediaIO``, ``AudioMediaIO``,
as vLLM's ``MediaConnector`` does), so images and videos come back as vLLM's
``MediaWithBytes`` and are keyed, like on vLLM's server, by their encoded bytes. Without
vLLM a small fallback decodes images with Pillow, videos from numpy ``.npy`` arrays and
audio from PCM WAV (stdlib ``wave``); those items are keyed by their decoded content.
Remote ``http(s)`` URLs are refused: fetching them (timeouts, size limits, allowed
domains) belongs to the server, which can plug in its own loader.

Bad media never escapes as a raw exception or a hang: files are opened without
following a final symlink and without blocking (a FIFO is refused, not waited on),
checked to lie under the allowed folder as opened, and read up to ``max_bytes``; images
are refused above ``max_pixels`` before they are decoded; an ``.npy`` header must not
declare more data than the bytes hold.
"""

from __future__ import annotations

import base64
import binascii
import io
import numbers
import operator
import os
import stat
import wave
from pathlib import Path
from typing import Any, Final, Protocol
from urllib.parse import urlparse
from urllib.request import url2pathname

import attrs
import numpy as np

from omni_requests import InvalidPromptError, PromptTypeError
from omni_requests._adapter_api import NOT_THE_INPUTS, type_name

__all__ = [
    "DefaultLoader",
    "MediaLoadError",
    "MediaLoader",
    "RemoteMediaError",
    "check_npy",
    "decode_wav",
    "read_under",
]

_MiB: Final = 1 << 20
_WAV_TYPES: Final = frozenset({"audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave"})


class MediaLoadError(InvalidPromptError):
    """A media URL could not be loaded (bad encoding, unsupported format, refused location)."""


class RemoteMediaError(MediaLoadError):
    """A remote ``http(s)`` URL was given; omni-requests does not fetch over the network."""


class MediaLoader(Protocol):
    """Turns a media URL of a chat message into the item a prompt carries.

    ``modality`` is ``"image"``, ``"video"`` or ``"audio"``. Return what vLLM's
    processors take for it (a PIL image or an HxWxC array; a TxHxWxC array; an
    ``(array, sampling_rate)`` pair). Raise :class:`MediaLoadError` (path ``"$"``) or
    ``ValueError``/``OSError`` for media that cannot be loaded; the chat parser adds
    where in the messages the URL was.
    """

    def __call__(self, modality: str, url: str) -> object: ...


def _readonly(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    # Nobody else holds these arrays, so freezing them in place lets the hasher cache their keys.
    array.flags.writeable = False
    return array


def decode_wav(data: bytes) -> tuple[np.ndarray[Any, Any], int]:
    """PCM WAV bytes as ``(float32 mono samples in [-1, 1), sampling rate)``, like vLLM's loader.

    The rate is an int, as vLLM's soundfile path returns it, so an item decoded here has
    the key of the same clip decoded by vLLM.

    Channels are averaged to mono. 8-bit (unsigned), 16-, 24- and 32-bit (signed)
    samples are read; compressed or floating-point WAV is not (``wave`` refuses it).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PromptTypeError("data", f"must be the WAV file's bytes, got {type_name(data)}")
    try:
        with wave.open(io.BytesIO(data)) as wav:
            channels, width, rate = wav.getnchannels(), wav.getsampwidth(), wav.getframerate()
            frames = wav.readframes(wav.getnframes())
    except (wave.Error, EOFError) as error:
        raise MediaLoadError("$", f"not a PCM WAV file: {error}") from None
    raw = np.frombuffer(frames, np.uint8)
    if width == 1:
        samples = (raw.astype(np.float32) - 128.0) / 128.0
    elif width == 2:
        samples = np.frombuffer(frames, "<i2").astype(np.float32) / float(1 << 15)
    elif width == 3:
        triples = raw.reshape(-1, 3).astype(np.int32)
        value = triples[:, 0] | (triples[:, 1] << 8) | (triples[:, 2] << 16)
        value = np.where(value & 0x800000, value - 0x1000000, value)
        samples = value.astype(np.float32) / float(1 << 23)
    elif width == 4:
        samples = np.frombuffer(frames, "<i4").astype(np.float32) / float(1 << 31)
    else:
        raise MediaLoadError("$", f"unsupported WAV sample width of {width} bytes")
    if channels > 1:
        samples = samples.reshape(-1, channels).mean(axis=1, dtype=np.float32)
    return _readonly(np.ascontiguousarray(samples, dtype=np.float32)), int(rate)


def _check_pixels(data: bytes, max_pixels: int) -> None:
    """Refuse an image whose header declares more than ``max_pixels``, before decoding it."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:  # reads the header only
            width, height = image.size
    except Image.DecompressionBombError as error:
        raise MediaLoadError("$", f"the image is too large to decode: {error}") from None
    except Exception:  # noqa: BLE001 - the decoder itself reports unreadable images
        return
    if width * height > max_pixels:
        raise MediaLoadError(
            "$",
            f"the image has {width}x{height} = {width * height} pixels, more than max_pixels={max_pixels}",
        )


def _decode_image(data: bytes, mode: str | None) -> object:
    from PIL import Image, ImageOps

    try:
        image: Any = Image.open(io.BytesIO(data))
        image = ImageOps.exif_transpose(image) or image
        image.load()
    except NOT_THE_INPUTS:
        raise
    except Exception as error:  # noqa: BLE001 - Pillow raises many kinds for bad input
        raise MediaLoadError("$", f"not an image Pillow can read: {type(error).__name__}: {error}") from None
    if mode is None:
        return image
    transparent = image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info
    if mode == "RGB" and transparent:
        # As vLLM does: composite over white rather than drop the alpha channel.
        rgba = image.convert("RGBA")
        flat = Image.new("RGB", rgba.size, (255, 255, 255))
        flat.paste(rgba, mask=rgba.getchannel("A"))
        return flat
    return image if image.mode == mode else image.convert(mode)


def check_npy(data: bytes) -> None:
    """Refuse ``.npy`` bytes whose header declares more data than they hold (or pickled objects).

    ``np.load`` allocates the declared shape before reading, so a 100-byte file declaring
    a terabyte would exhaust memory; this reads the header alone.
    """
    from numpy.lib import format as numpy_format

    npy: Any = numpy_format
    buffer = io.BytesIO(data)
    try:
        version = npy.read_magic(buffer)
        if version == (1, 0):
            shape, _, dtype = npy.read_array_header_1_0(buffer)
        elif version == (2, 0):
            shape, _, dtype = npy.read_array_header_2_0(buffer)
        else:
            raise ValueError(f"unsupported .npy format version {version}")
    except (ValueError, OSError, EOFError, SyntaxError) as error:
        raise MediaLoadError("$", f"not a numpy .npy array: {error}") from None
    if dtype.hasobject:
        raise MediaLoadError("$", "a .npy array of Python objects cannot be loaded safely")
    declared = int(np.prod(shape, dtype=object)) * dtype.itemsize
    held = len(data) - buffer.tell()
    if declared > held:
        raise MediaLoadError(
            "$", f"the .npy header declares shape {shape} ({declared} bytes) but the data holds {held} bytes"
        )


def _decode_npy_video(data: bytes) -> np.ndarray[Any, Any]:
    check_npy(data)
    try:
        video = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as error:
        raise MediaLoadError("$", f"not a numpy .npy array: {error}") from None
    if not isinstance(video, np.ndarray) or video.ndim != 4:
        shape = getattr(video, "shape", None)
        raise MediaLoadError(
            "$", f"a video array must have 4 dimensions (frames, height, width, channels), got shape {shape}"
        )
    if video.dtype.kind not in "uif":
        raise MediaLoadError("$", f"a video array must be numeric, got dtype {video.dtype}")
    return _readonly(video)


def _resolved(path: str | Path | None) -> Path | None:
    if path is None:
        return None
    if not isinstance(path, (str, os.PathLike)):
        raise PromptTypeError(
            "allowed_local_media_path", f"must be a str, a path or None, got {type_name(path)}"
        )
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError, ValueError, TypeError) as error:  # a NUL byte, a symlink loop
        raise InvalidPromptError("allowed_local_media_path", f"cannot resolve {path!r}: {error}") from None


def _positive_int(name: str, value: object) -> int:
    # Any integer (numpy's too: a limit read from a config array), never a bool; kept as
    # Python's int, which the size arithmetic cannot overflow (np.int64's max + 1 would).
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise PromptTypeError(name, f"must be an int, got {type_name(value)}")
    limit = operator.index(value)
    if limit < 1:
        raise InvalidPromptError(name, f"must be at least 1, got {limit}")
    return limit


def _max_bytes(value: int) -> int:
    return _positive_int("max_bytes", value)


def _max_pixels(value: int) -> int:
    return _positive_int("max_pixels", value)


def _use_vllm(value: bool | None) -> bool | None:
    if value is not None and not isinstance(value, (bool, np.bool_)):
        raise PromptTypeError("use_vllm", f"must be a bool or None, got {type_name(value)}")
    return None if value is None else bool(value)


def _optional(kinds: tuple[type, ...], name: str) -> Any:
    def check(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if value is not None and not isinstance(value, kinds):
            raise PromptTypeError(attribute.name, f"must be {name} or None, got {type_name(value)}")

    return check


def _vllm_installed() -> bool:
    try:
        import vllm.multimodal.media  # noqa: F401
    except ImportError:
        return False
    return True


def read_under(root: Path, path: Path, max_bytes: int) -> bytes:
    """The bytes of the regular file ``path`` (already resolved and checked to lie under ``root``).

    Opened without following a final symlink and without blocking, then checked as
    opened: a regular file (not a FIFO, device or folder), still under ``root`` (a
    component swapped for a symlink between the check and the open is caught here), at
    most ``max_bytes`` long.
    """
    flags = (
        os.O_RDONLY
        | getattr(os, "O_NONBLOCK", 0)
        | getattr(os, "O_NOFOLLOW", 0)
        | getattr(os, "O_CLOEXEC", 0)
    )
    try:
        fd = os.open(path, flags)
    except OSError as error:
        raise MediaLoadError("$", f"cannot open {str(path)!r}: {error.strerror or error}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise MediaLoadError("$", f"{str(path)!r} is not a regular file (a FIFO, device or folder)")
        try:
            opened = Path(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # no /proc: the file opened must be the one checked
            checked = os.stat(path, follow_symlinks=False)
            if (checked.st_dev, checked.st_ino) != (info.st_dev, info.st_ino):
                raise MediaLoadError("$", f"{str(path)!r} changed between the check and the read") from None
        else:
            if root not in opened.parents:
                raise MediaLoadError(
                    "$",
                    f"{str(path)!r} resolved outside allowed_local_media_path when opened ({str(opened)!r})",
                )
        if info.st_size > max_bytes:
            raise MediaLoadError("$", f"the file has {info.st_size} bytes, more than max_bytes={max_bytes}")
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > max_bytes:
            raise MediaLoadError("$", f"the file has more than max_bytes={max_bytes} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


@attrs.frozen
class DefaultLoader:
    """Loads ``data:`` URLs (base64) and ``file://`` URLs under ``allowed_local_media_path``.

    With vLLM installed (``use_vllm=None``, the default, or ``True``), items are decoded by
    vLLM's own media IO, as vLLM's ``MediaConnector`` does for its server:

    - image: vLLM's ``ImageMediaIO(image_mode)``, a ``MediaWithBytes`` keyed by the file's
      bytes (and ``io_config`` where the mode was converted);
    - video: ``data:video/jpeg;base64,<frame>,<frame>...`` (JPEG frames) and files through
      vLLM's ``VideoMediaIO`` (other formats need vLLM's video backend, e.g. OpenCV);
      numpy ``.npy`` arrays (``data:video/x-npy;base64,...`` or a ``.npy`` file) by the
      fallback below;
    - audio: vLLM's ``AudioMediaIO``; where vLLM has no audio backend installed
      (soundfile, PyAV or torchcodec), PCM WAV by the fallback below, which decodes
      8-, 16-, 24- and 32-bit PCM, mono and stereo, to the same samples as vLLM's
      soundfile path (tested).

    Without vLLM (or ``use_vllm=False``): images with Pillow (turned upright by EXIF,
    converted to ``image_mode``, transparency over white), videos from ``.npy`` arrays,
    audio from PCM WAV as ``(float32 mono, rate)``; keyed by their decoded content.

    Local files are refused unless ``allowed_local_media_path`` is set, and must lie
    under it, as with vLLM's ``--allowed-local-media-path``. ``max_bytes`` bounds the
    encoded size of one item, ``max_pixels`` the decoded size of an image.
    """

    allowed_local_media_path: Path | None = attrs.field(default=None, converter=_resolved)
    image_mode: str | None = attrs.field(default="RGB", validator=_optional((str,), "a str"))
    max_bytes: int = attrs.field(default=64 * _MiB, converter=_max_bytes)
    max_pixels: int = attrs.field(default=64 * _MiB, converter=_max_pixels)
    use_vllm: bool | None = attrs.field(default=None, converter=_use_vllm)

    def __call__(self, modality: str, url: str) -> object:
        if not isinstance(url, str):
            raise MediaLoadError("$", f"a media URL must be a str, got {type(url).__name__}")
        scheme = url.partition(":")[0].lower() if ":" in url else ""
        if scheme in ("http", "https"):
            raise RemoteMediaError(
                "$",
                f"remote URL {url[:80]!r} is out of scope: omni-requests does not fetch media over "
                "the network. Download it yourself and pass a data: URL, or give chat_to_prompt a "
                "loader that fetches (with the timeouts and size limits your server needs).",
            )
        payload = None
        if scheme == "data":
            media_type, payload = self._data_url(url)
            data = None
        elif scheme == "file":
            media_type, data = self._file_url(url)
        else:
            raise MediaLoadError(
                "$", f"unsupported media URL {url[:80]!r}: give a base64 data: URL or a file:// URL"
            )
        try:
            return self._decode(modality, media_type, data, payload)
        except (MediaLoadError, *NOT_THE_INPUTS):
            raise
        except Exception as error:  # noqa: BLE001 - decoders raise many kinds for bad media
            raise MediaLoadError(
                "$", f"cannot decode the {modality}: {type(error).__name__}: {error}"
            ) from None

    def _data_url(self, url: str) -> tuple[str, str]:
        header, comma, payload = url[len("data:") :].partition(",")
        media_type, _, encoding = header.rpartition(";")
        if not comma or encoding.lower() != "base64":
            raise MediaLoadError("$", "only base64 data URLs are supported (data:<type>;base64,<data>)")
        if len(payload.rstrip("=")) * 3 // 4 > self.max_bytes:  # the decoded size, padding left out
            raise MediaLoadError("$", f"the media is larger than max_bytes={self.max_bytes}")
        return media_type.partition(";")[0].strip().lower(), payload

    def _file_url(self, url: str) -> tuple[str, bytes]:
        root = self.allowed_local_media_path
        if root is None:
            raise MediaLoadError(
                "$",
                "cannot load local files without allowed_local_media_path "
                "(like vLLM's --allowed-local-media-path)",
            )
        parsed = urlparse(url)
        try:
            path = Path(url2pathname(parsed.netloc + parsed.path)).resolve()
        except (OSError, RuntimeError, ValueError) as error:  # a symlink loop, a NUL byte
            raise MediaLoadError("$", f"cannot resolve {url[:80]!r}: {error}") from None
        if root not in path.parents:
            raise MediaLoadError(
                "$", f"the file {str(path)!r} is not under allowed_local_media_path {str(root)!r}"
            )
        return _type_of_suffix(path.suffix.lower()), read_under(root, path, self.max_bytes)

    def _vllm(self) -> bool:
        return _vllm_installed() if self.use_vllm is None else self.use_vllm

    def _decode(self, modality: str, media_type: str, data: bytes | None, payload: str | None) -> object:
        jpeg_frames = modality == "video" and media_type == "video/jpeg" and payload is not None
        if data is None and not jpeg_frames:
            data = _b64decode(payload or "")
        if modality == "image":
            assert data is not None
            _check_pixels(data, self.max_pixels)
            if self._vllm():
                from vllm.multimodal.media import ImageMediaIO

                return ImageMediaIO(image_mode=self.image_mode).load_bytes(data)
            return _decode_image(data, self.image_mode)
        if modality == "video":
            if data is not None and "npy" in media_type:
                return _decode_npy_video(data)
            if not self._vllm():
                raise MediaLoadError(
                    "$",
                    f"cannot decode a {media_type or 'untyped'} video: without vLLM the default loader "
                    "reads numpy .npy arrays (data:video/x-npy;base64,... or a .npy file); "
                    "plug in a loader with a video decoder",
                )
            from vllm.multimodal.media import ImageMediaIO, VideoMediaIO

            video_io = VideoMediaIO(ImageMediaIO(image_mode=self.image_mode))
            if jpeg_frames:
                assert payload is not None
                for frame in payload.split(","):
                    _check_pixels(_b64decode(frame), self.max_pixels)
                return video_io.load_base64(media_type, payload)
            assert data is not None
            return video_io.load_bytes(data)
        if modality == "audio":
            assert data is not None
            if self._vllm():
                from vllm.multimodal.media import AudioMediaIO

                try:
                    return AudioMediaIO().load_bytes(data)
                except ImportError:
                    if media_type not in _WAV_TYPES:
                        raise
            if media_type not in _WAV_TYPES:
                raise MediaLoadError(
                    "$",
                    f"cannot decode {media_type or 'untyped'} audio: the default loader reads PCM WAV "
                    "(audio/wav, .wav); plug in a loader with an audio decoder",
                )
            return decode_wav(data)
        raise MediaLoadError("$", f"no default loader for modality {modality!r}")


def _b64decode(payload: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise MediaLoadError("$", f"invalid base64 in data URL: {error}") from None


def _type_of_suffix(suffix: str) -> str:
    if suffix == ".npy":
        return "application/x-npy"
    if suffix in (".wav", ".wave"):
        return "audio/wav"
    if suffix in (".jpg", ".jpeg"):
        return "image/jpeg"
    return "application/octet-stream"  # images are recognised by their content
