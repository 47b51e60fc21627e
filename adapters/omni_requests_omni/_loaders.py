"""Loading the media a chat message points at: data URLs and local files, never the network.

A loader is any callable ``(modality, url) -> item``; :class:`DefaultLoader` reads
base64 ``data:`` URLs and ``file://`` URLs under an allowed folder, decoding images with
Pillow, videos from numpy ``.npy`` arrays and audio from PCM WAV (stdlib ``wave``).
Remote ``http(s)`` URLs are refused: fetching them (timeouts, size limits, allowed
domains) belongs to the server, which can plug in its own loader.
"""

from __future__ import annotations

import base64
import binascii
import io
import wave
from pathlib import Path
from typing import Any, Final, Protocol
from urllib.parse import urlparse
from urllib.request import url2pathname

import attrs
import numpy as np

from omni_requests import InvalidPromptError

__all__ = ["DefaultLoader", "MediaLoadError", "MediaLoader", "RemoteMediaError", "decode_wav"]

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


def decode_wav(data: bytes) -> tuple[np.ndarray[Any, Any], float]:
    """PCM WAV bytes as ``(float32 mono samples in [-1, 1), sampling rate)``, like vLLM's loader.

    Channels are averaged to mono. 8-bit (unsigned), 16-, 24- and 32-bit (signed)
    samples are read; compressed or floating-point WAV is not (``wave`` refuses it).
    """
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
    return _readonly(np.ascontiguousarray(samples, dtype=np.float32)), float(rate)


def _decode_image(data: bytes, mode: str) -> object:
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError) as error:
        raise MediaLoadError("$", f"not an image Pillow can read: {error}") from None
    transparent = image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info
    if mode == "RGB" and transparent:
        # As vLLM does: composite over white rather than drop the alpha channel.
        rgba = image.convert("RGBA")
        flat = Image.new("RGB", rgba.size, (255, 255, 255))
        flat.paste(rgba, mask=rgba.getchannel("A"))
        return flat
    return image if image.mode == mode else image.convert(mode)


def _decode_npy_video(data: bytes) -> np.ndarray[Any, Any]:
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
    return None if path is None else Path(path).resolve()


@attrs.frozen
class DefaultLoader:
    """Loads ``data:`` URLs (base64) and ``file://`` URLs under ``allowed_local_media_path``.

    - image: anything Pillow reads, converted to ``image_mode`` (``"RGB"`` like vLLM,
      transparent pixels composited over white);
    - video: a numpy ``.npy`` array of shape (frames, height, width, channels)
      (``data:video/x-npy;base64,...`` or a ``.npy`` file): decoding mp4 and friends
      needs a video library, so plug in a loader that has one;
    - audio: PCM WAV (``audio/wav``, ``.wav``), as ``(float32 mono, rate)``.

    Local files are refused unless ``allowed_local_media_path`` is set, and must lie
    under it, as with vLLM's ``--allowed-local-media-path``. ``max_bytes`` bounds the
    encoded size of one item.
    """

    allowed_local_media_path: Path | None = attrs.field(default=None, converter=_resolved)
    image_mode: str = "RGB"
    max_bytes: int = 64 * _MiB

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
        if scheme == "data":
            media_type, data = self._data_url(url)
        elif scheme == "file":
            media_type, data = self._file_url(url)
        else:
            raise MediaLoadError(
                "$", f"unsupported media URL {url[:80]!r}: give a base64 data: URL or a file:// URL"
            )
        return self._decode(modality, media_type, data)

    def _data_url(self, url: str) -> tuple[str, bytes]:
        header, comma, payload = url[len("data:") :].partition(",")
        media_type, _, encoding = header.rpartition(";")
        if not comma or encoding.lower() != "base64":
            raise MediaLoadError("$", "only base64 data URLs are supported (data:<type>;base64,<data>)")
        if len(payload) * 3 // 4 > self.max_bytes:
            raise MediaLoadError("$", f"the media is larger than max_bytes={self.max_bytes}")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as error:
            raise MediaLoadError("$", f"invalid base64 in data URL: {error}") from None
        return media_type.partition(";")[0].strip().lower(), data

    def _file_url(self, url: str) -> tuple[str, bytes]:
        root = self.allowed_local_media_path
        if root is None:
            raise MediaLoadError(
                "$",
                "cannot load local files without allowed_local_media_path "
                "(like vLLM's --allowed-local-media-path)",
            )
        parsed = urlparse(url)
        path = Path(url2pathname(parsed.netloc + parsed.path)).resolve()
        if root not in path.parents:
            raise MediaLoadError(
                "$", f"the file {str(path)!r} is not under allowed_local_media_path {str(root)!r}"
            )
        size = path.stat().st_size
        if size > self.max_bytes:
            raise MediaLoadError("$", f"the file has {size} bytes, more than max_bytes={self.max_bytes}")
        return _type_of_suffix(path.suffix.lower()), path.read_bytes()

    def _decode(self, modality: str, media_type: str, data: bytes) -> object:
        if modality == "image":
            return _decode_image(data, self.image_mode)
        if modality == "video":
            if "npy" not in media_type:
                raise MediaLoadError(
                    "$",
                    f"cannot decode a {media_type or 'untyped'} video: the default loader reads "
                    "numpy .npy arrays (data:video/x-npy;base64,... or a .npy file); "
                    "plug in a loader with a video decoder",
                )
            return _decode_npy_video(data)
        if modality == "audio":
            if media_type not in _WAV_TYPES:
                raise MediaLoadError(
                    "$",
                    f"cannot decode {media_type or 'untyped'} audio: the default loader reads PCM WAV "
                    "(audio/wav, .wav); plug in a loader with an audio decoder",
                )
            return decode_wav(data)
        raise MediaLoadError("$", f"no default loader for modality {modality!r}")


def _type_of_suffix(suffix: str) -> str:
    if suffix == ".npy":
        return "application/x-npy"
    if suffix in (".wav", ".wave"):
        return "audio/wav"
    return "application/octet-stream"  # images are recognised by their content
