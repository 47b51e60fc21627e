"""Sealed images and tensors: a record's key is computed once and never goes stale.

A record copies each PIL image and tensor once, into a store no one else can reach (a
memfd the kernel refuses to write, or a private ``bytearray`` for small items), and hands
out fresh images and tensors over it. Every test writes where a caller could (the
caller's own object, the record's view, what ``to_vllm`` sent) by every road we know,
and checks that the record goes on sending the sealed bytes under their key, that the
key is the one a fresh hash gives, and that it was hashed once. Both stores are tested.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import io
import mmap
import os
import pickle
import tempfile
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageOps
from PIL.TiffImagePlugin import IFDRational

from omni_requests import (
    InvalidPromptError,
    MediaHasher,
    PromptTypeError,
    TextPrompt,
    _sealed,
    scope_to_replica,
    testing,
    wire,
)
from omni_requests._exif import EXIF_IMAGE_ID, EXIF_ORIENTATION, exif_of, exif_view
from omni_requests_vllm import from_vllm, to_vllm

from .conftest import CountingHasher as Counting

torch = pytest.importorskip("torch")

HASHER = MediaHasher("/models/tiny-vl")
SIDE = 640  # 640 x 640 RGB: 1.6 MB in Pillow's layout, a mapped store


@pytest.fixture(params=["mapped", "copied"])
def store(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test runs with memfd stores, then with bytes stores (no file budget left)."""
    if request.param == "copied":
        monkeypatch.setattr(_sealed._BUDGET, "limit", 0)
    elif not _sealed._SEAL_ALL:
        pytest.skip("no sealed memfds on this system")
    return str(request.param)


def _image(seed: int = 1, mode: str = "RGB") -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
    return Image.fromarray(pixels).convert(mode)


def _tensor(seed: int = 1) -> Any:
    # A video of 4 frames, 160 x 160 x 3 float32: 1.2 MB, a mapped store.
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((4, 160, 160, 3)).astype(np.float32))


def _sent(record: Any, modality: str = "image") -> tuple[str, Any]:
    out = to_vllm(scope_to_replica(record, 0, hasher=HASHER))
    return out["multi_modal_uuids"][modality][0], out["multi_modal_data"][modality][0]


def _fresh_key(modality: str, item: Any) -> str:
    """The scoped key of ``item`` hashed afresh from a plain copy (no cache can answer)."""
    plain = Image.Image.copy(item) if isinstance(item, Image.Image) else item.clone()
    return "stage0:rep0:" + MediaHasher(HASHER.model_id).content_key(modality, plain)


def _same_pixels(a: Image.Image, b: Image.Image) -> bool:
    return (a.mode, a.size, a.tobytes()) == (b.mode, b.size, b.tobytes())


def _raw_write(image: Any) -> None:
    """Bytes written into a hand-out's memory below Pillow and torch, as a raw pointer would."""
    buffer = image._sealed[2]
    if buffer is None:  # packed RGB (Pillow before 13): the hand-out owns its pixels, a copy
        image.im.putpixel((0, 0), (255, 255, 255))  # no shared memory to reach below Pillow
        return
    np.frombuffer(buffer, np.uint8)[:64] ^= 0xFF


def _rgb_hand_outs_are_mappings() -> bool:
    """Whether an RGB hand-out shares the store's memory (Pillow 13 on); before, it is a
    copy no page check can watch: never pristine, and sealed again when given back."""
    return _sealed._rgb_over_rgbx()


IMAGE_WRITES: dict[str, Callable[[Any], None]] = {
    "frombytes": lambda image: image.frombytes(bytes(image.width * image.height * 3)),
    "readonly reset, putpixel": lambda image: (
        setattr(image, "readonly", 0),
        image.putpixel((0, 0), (1, 2, 3)),
    ),
    "paste": lambda image: image.paste((9, 9, 9), (0, 0, 16, 16)),
    "ImageDraw": lambda image: ImageDraw.Draw(image).rectangle((0, 0, 8, 8), fill=(7, 7, 7)),
    "core putpixel": lambda image: image.im.putpixel((3, 3), (5, 5, 5)),
    "core pixel access": lambda image: image.im.pixel_access(0).__setitem__((1, 1), (4, 4, 4)),
    "info": lambda image: image.info.__setitem__("transparency", (1, 2, 3)),
    "raw memory": _raw_write,
}


def test_a_store_whose_descriptor_another_file_took_is_never_read() -> None:
    # Code that closes descriptors it does not own (os.closerange, a daemonizing helper)
    # frees the store's number for the next file opened: the record used to map that
    # file and send its bytes under the key it had cached.
    if not _sealed._SEAL_ALL:
        pytest.skip("no sealed memfds on this system")
    record = TextPrompt(prompt="<video>", multi_modal_data={"video": _tensor()})
    _sent(record, "video")
    seal = _sealed.seal_of(record.multi_modal_data["video"][0])
    assert seal is not None and seal._fd is not None
    fd = seal._fd
    with tempfile.TemporaryFile() as other:
        other.write(bytes(seal.nbytes + 64))
        other.flush()
        os.close(fd)
        os.dup2(other.fileno(), fd)  # another file, at the store's number
    with pytest.raises(RuntimeError, match="closed by code that does not own it"):
        _sent(record, "video")
    del record, seal
    gc.collect()
    os.fstat(fd)  # the record let go of its store without closing the other file
    os.close(fd)


def test_a_small_store_cannot_be_written_through_a_hand_outs_private_attributes() -> None:
    # Below 1 MiB the store lives in this process: a hand-out reaches it through its
    # private attributes, and a bytearray there could be written from plain Python.
    small = Image.fromarray(np.random.default_rng(4).integers(0, 256, (32, 32, 3), dtype=np.uint8))
    record = TextPrompt(prompt="<image>", multi_modal_data={"image": small})
    first, sent = _sent(record)
    store = sent._sealed[0]._bytes
    with pytest.raises(TypeError):
        memoryview(store)[:4] = b"\xff\xff\xff\xff"
    with pytest.raises((TypeError, AttributeError)):
        store[:4] = b"\xff\xff\xff\xff"
    key, again = _sent(record)
    assert key == first == _fresh_key("image", again) and _same_pixels(again, small)


@pytest.mark.parametrize("write", list(IMAGE_WRITES), ids=list(IMAGE_WRITES))
def test_writes_to_what_a_record_sent_or_shows_never_reach_it(store: str, write: str) -> None:
    original = _image()
    record = TextPrompt(prompt="<image>", multi_modal_data={"image": original})
    first, sent = _sent(record)
    assert first == _fresh_key("image", original)
    for target in (sent, record.multi_modal_data["image"][0]):
        if write == "raw memory" and store == "copied":
            _raw_write(target)  # a bytearray of its own: the same road
        else:
            IMAGE_WRITES[write](target)
        key, again = _sent(record)
        assert key == first == _fresh_key("image", again)
        assert _same_pixels(again, original) and again.info == original.info
    assert _same_pixels(pickle.loads(pickle.dumps(record)).multi_modal_data["image"][0], original)


@pytest.mark.parametrize("write", list(IMAGE_WRITES), ids=list(IMAGE_WRITES))
def test_a_changed_hand_out_copies_and_seals_its_change_not_the_records(store: str, write: str) -> None:
    # copy() of an untouched hand-out is another hand-out (no pixels copied); of a changed
    # one, a copy of what it holds now: vLLM's parser copies every image it is given.
    record = TextPrompt(prompt="<image>", multi_modal_data={"image": _image()})
    _, sent = _sent(record)
    mapped = _rgb_hand_outs_are_mappings()
    assert sent.pristine() is mapped and (type(sent.copy()) is type(sent)) is mapped
    IMAGE_WRITES[write](sent)
    assert not sent.pristine()
    copied = ImageOps.exif_transpose(sent)
    assert _same_pixels(copied, sent) and copied.info == sent.info
    # Given to a new record, the changed image is sealed anew with what it holds now.
    reused = TextPrompt(prompt="<image>", multi_modal_data={"image": sent})
    key, again = _sent(reused)
    assert _same_pixels(again, sent) and key == _fresh_key("image", sent)


def test_the_callers_own_image_and_tensor_changed_later_do_not_reach_the_record(store: str) -> None:
    image, tensor = _image(), _tensor()
    before_image, before_tensor = image.copy(), tensor.clone()
    record = TextPrompt(prompt="<image><video>", multi_modal_data={"image": image, "video": [tensor]})
    image.paste((0, 0, 0), (0, 0, SIDE, SIDE))
    tensor.zero_()
    out = to_vllm(record)
    assert _same_pixels(out["multi_modal_data"]["image"][0], before_image)
    assert torch.equal(out["multi_modal_data"]["video"][0], before_tensor)


TENSOR_WRITES: dict[str, Callable[[Any], None]] = {
    "in place": lambda t: t.add_(1),
    "numpy": lambda t: t.numpy().__setitem__((0, 0, 0), -1.0),
    ".data": lambda t: t.data.__setitem__((1, 1, 1), -2.0),
    "resize_": lambda t: t.resize_(3),
    "set_": lambda t: t.set_(torch.zeros(2)),
    "as_strided_": lambda t: t.as_strided_((2, 2), (1, 1)),
    "data swapped": lambda t: setattr(t, "data", torch.ones(5)),
    "raw memory": lambda t: ctypes.memset(t.data_ptr(), 0xFF, 64),
}


@pytest.mark.parametrize("write", list(TENSOR_WRITES), ids=list(TENSOR_WRITES))
def test_writes_to_a_tensor_a_record_sent_or_shows_never_reach_it(store: str, write: str) -> None:
    original = _tensor()
    record = TextPrompt(prompt="<video>", multi_modal_data={"video": [original]})
    first, sent = _sent(record, "video")
    assert first == _fresh_key("video", original)
    version = sent._version
    for target in (sent, record.multi_modal_data["video"][0]):
        TENSOR_WRITES[write](target)
        key, again = _sent(record, "video")
        assert key == first == _fresh_key("video", again)
        assert torch.equal(again, original) and again.dtype == original.dtype
    if write in ("numpy", "raw memory"):
        assert sent._version == version  # torch's counter saw nothing: no cache could rest on it


@pytest.mark.parametrize("bit", ["conjugate", "negative"])
def test_a_tensor_hand_out_given_back_after_a_view_bit_was_set_in_place_is_read_as_it_is_now(
    store: str, bit: str
) -> None:
    # torch._C._set_conj and _set_neg flip a bit on the tensor itself: no byte, no shape,
    # no stride changes, yet the tensor now reads other values (vLLM cannot hash it).
    dtype = torch.complex64 if bit == "conjugate" else torch.float32
    record = TextPrompt(prompt="<video>", multi_modal_data={"video": [_tensor().to(dtype)]})
    _, sent = _sent(record, "video")
    (torch._C._set_conj if bit == "conjugate" else torch._C._set_neg)(sent, True)
    with pytest.raises(PromptTypeError, match="vLLM's hasher cannot read this tensor"):
        TextPrompt(prompt="<video>", multi_modal_data={"video": [sent]})


def test_a_tensor_hand_outs_storage_cannot_grow_as_with_any_tensor_from_numpy(store: str) -> None:
    # What docs/design.md says its holder may not do; everything else in TENSOR_WRITES it may.
    record = TextPrompt(prompt="<video>", multi_modal_data={"video": [_tensor()]})
    sent = _sent(record, "video")[1]
    with pytest.raises(RuntimeError, match="not resizable"):
        sent.resize_(sent.numel() + 1)
    with pytest.raises(RuntimeError, match="not resizable"):
        torch.from_numpy(np.zeros(4, np.float32)).resize_(5)  # the same refusal, by torch


def _base(record: Any, replica: int, hasher: MediaHasher, modality: str) -> str:
    key: str = to_vllm(scope_to_replica(record, replica, hasher=hasher))["multi_modal_uuids"][modality][0]
    return key.rsplit(":", 1)[1]


@pytest.mark.parametrize("kind", ["image", "tensor"])
def test_a_sealed_item_is_hashed_once_however_often_it_is_sent(store: str, kind: str) -> None:
    Counting.computed = Counter()
    hasher = Counting("/models/tiny-vl-count")
    item = _image(3) if kind == "image" else _tensor(3)
    modality = "image" if kind == "image" else "video"
    template = TextPrompt(prompt="x", multi_modal_data={modality: [item]})
    keys = {_base(template, n % 2, hasher, modality) for n in range(20)}
    # A pristine hand-out given back (from_vllm of the engine dict) keeps the seal and key.
    keys.add(_base(from_vllm(to_vllm(template)), 1, hasher, modality))
    assert len(keys) == 1
    # Untouched, a tensor hand-out keeps its seal too; a copied RGB one (Pillow before 13)
    # is sealed anew.
    resealed = kind == "image" and not _rgb_hand_outs_are_mappings()
    assert sum(Counting.computed.values()) == (2 if resealed else 1)


def test_the_kernel_refuses_every_write_to_a_mapped_store() -> None:
    if not _sealed._SEAL_ALL:
        pytest.skip("no sealed memfds on this system")
    record = TextPrompt(prompt="x", multi_modal_data={"image": _image(4)})
    seal = record.multi_modal_data["image"][0]._sealed[0]
    assert seal._fd is not None
    # Opened again through /proc (as anyone in the process could), it takes no write.
    fd = os.open(f"/proc/self/fd/{seal._fd}", os.O_RDWR)
    try:
        with pytest.raises(PermissionError):
            os.write(fd, b"\0")
        with pytest.raises(PermissionError):
            mmap.mmap(fd, seal.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)
    assert _same_pixels(_sent(record)[1], _image(4))


@contextlib.contextmanager
def _budget(limit: int) -> Iterator[None]:
    saved = _sealed._BUDGET.limit
    _sealed._BUDGET.limit = limit
    try:
        yield
    finally:
        _sealed._BUDGET.limit = saved


def test_stores_give_their_files_back_and_never_exceed_their_budget() -> None:
    if not _sealed._SEAL_ALL:
        pytest.skip("no sealed memfds on this system")
    gc.collect()
    before = _sealed._BUDGET.open
    with _budget(before + 2):
        records = [TextPrompt(prompt="x", multi_modal_data={"image": _image(n)}) for n in range(4)]
        mapped = [r.multi_modal_data["image"][0]._sealed[0]._fd is not None for r in records]
        assert mapped == [True, True, False, False]  # past the budget: bytes stores, same keys
        assert _sealed._BUDGET.open == before + 2
        keys = [_sent(r)[0] for r in records]
        assert keys == [_fresh_key("image", _image(n)) for n in range(4)]
    del records
    gc.collect()
    assert _sealed._BUDGET.open == before


@pytest.mark.parametrize(
    "item",
    [
        pytest.param(lambda: Image.new("I", (8, 8)), id="32-bit image"),
        pytest.param(
            lambda: torch.nn.Parameter(torch.zeros(3, 4), requires_grad=False), id="tensor subclass"
        ),
    ],
)
def test_what_cannot_be_sealed_is_kept_as_given_and_hashed_at_every_render(item: Callable[[], Any]) -> None:
    value = item()
    modality = "image"
    record = TextPrompt(prompt="x", multi_modal_data={modality: [value]})
    assert record.multi_modal_data[modality][0] is value
    first, _ = _sent(record, modality)
    if isinstance(value, Image.Image):
        value.putpixel((0, 0), 1000)
    else:
        value.data.add_(1)
    key, sent = _sent(record, modality)
    assert sent is value and key != first and key == _fresh_key(modality, value)


def test_replace_media_keeps_the_other_modalities_sealed_items_as_they_are(store: str) -> None:
    Counting.computed = Counter()
    hasher = Counting("/models/tiny-vl-replace")
    template = TextPrompt(prompt="x", multi_modal_data={"image": _image(6), "video": [_tensor(6)]})
    keys = to_vllm(scope_to_replica(template, 0, hasher=hasher))["multi_modal_uuids"]
    computed = sum(Counting.computed.values())
    copy = template.replace_media({"audio": [np.zeros(16, np.float32)]})
    assert copy.multi_modal_data["image"] is template.multi_modal_data["image"]  # not sealed again
    assert copy.multi_modal_data["video"] is template.multi_modal_data["video"]
    again = to_vllm(scope_to_replica(copy, 0, hasher=hasher))["multi_modal_uuids"]
    assert (again["image"], again["video"]) == (keys["image"], keys["video"])
    assert sum(Counting.computed.values()) == computed + 1  # the new audio alone


def test_a_records_item_list_given_as_another_modality_is_checked_again() -> None:
    # A record's own list passes through unchecked only for its own modality: as video,
    # its items (images) are each read as a video, and refused as one.
    record = TextPrompt(prompt="x", multi_modal_data={"image": [_image(7), _image(8)]})
    with pytest.raises(PromptTypeError, match="a single PIL image is not a video") as caught:
        TextPrompt(prompt="x", multi_modal_data={"video": record.multi_modal_data["image"]})
    assert caught.value.path == "$.multi_modal_data.video[0]"


def test_a_hand_out_equals_the_plain_image_it_was_sealed_from_and_pickles_as_one(store: str) -> None:
    original = _image(9)
    record = TextPrompt(prompt="x", multi_modal_data={"image": original})
    shown, (_, sent) = record.multi_modal_data["image"][0], _sent(record)
    assert shown == original and original == sent and sent == shown  # Pillow's own == checks the class
    sent.putpixel((0, 0), (1, 1, 1))
    assert sent != original
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        back = pickle.loads(pickle.dumps(shown, protocol))
        assert type(back) is Image.Image and back == original


def test_mapped_stores_may_hold_a_quarter_of_the_open_file_limit() -> None:
    # docs/design.md: at most a quarter of RLIMIT_NOFILE, read when omni_requests is imported.
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    expected = (soft if soft != resource.RLIM_INFINITY else 1 << 16) // 4
    assert _sealed._open_files_share() == _sealed._BUDGET.limit == expected


def test_hand_outs_hold_no_open_file_however_many_are_kept() -> None:
    # A template sent for a batch of requests kept together (llm.generate's list): each
    # hand-out is a mapping of the store, not another open file.
    if not _sealed._SEAL_ALL:
        pytest.skip("no sealed memfds on this system")
    template = TextPrompt(prompt="<image>", multi_modal_data={"image": _image(), "video": _tensor()})
    before = len(os.listdir("/proc/self/fd"))
    batch = [to_vllm(template) for _ in range(300)]
    assert len(os.listdir("/proc/self/fd")) - before < 5
    assert _same_pixels(batch[-1]["multi_modal_data"]["image"][0], _image())
    del batch
    gc.collect()


def _changed_views(record: TextPrompt) -> tuple[Any, Any]:
    image, video = record.multi_modal_data["image"][0], record.multi_modal_data["video"][0]
    image.paste((0, 0, 0), (0, 0, SIDE, SIDE))  # the view's holder may change it freely
    video.zero_()
    return image, video


def test_a_hashers_public_calls_read_a_changed_view_as_it_is_and_the_record_its_seal(store: str) -> None:
    record = TextPrompt(prompt="<image><video>", multi_modal_data={"image": _image(), "video": _tensor()})
    keyed = {m: _sent(record, m)[0] for m in ("image", "video")}
    image, video = _changed_views(record)
    for modality, view, plain in (("image", image, Image.Image.copy(image)), ("video", video, video.clone())):
        for call in (HASHER.key, HASHER.content_key, HASHER.fingerprint):
            assert call(modality, view) == call(modality, plain), call.__name__
        key, sent = _sent(record, modality)
        assert key == keyed[modality] != "stage0:rep0:" + HASHER.content_key(modality, view)
        assert key == _fresh_key(modality, sent)
    vllm_hasher = pytest.importorskip("vllm.multimodal.hasher").MultiModalHasher
    for modality, view in (("image", image), ("video", video)):
        assert HASHER.key(modality, view) == vllm_hasher.hash_kwargs(
            "blake3", model_id=HASHER.model_id, **{modality: view}
        )


def test_scope_stage0_sends_a_changed_view_in_a_dict_as_it_is(store: str) -> None:
    omni = pytest.importorskip("omni_requests_omni")
    record = TextPrompt(prompt="<image><video>", multi_modal_data={"image": _image(), "video": _tensor()})
    image, video = _changed_views(record)
    pool = omni.Stage0Pool(replicas=2, select=lambda request: 1)
    given = {"prompt": "<image><video>", "multi_modal_data": {"image": image, "video": video}}
    _, out = omni.scope_stage0(given, pool=pool, hasher=HASHER, request_id="r")
    data = out["multi_modal_data"]
    sent_image = data["image"][0] if isinstance(data["image"], list) else data["image"]
    sent_video = data["video"][0] if isinstance(data["video"], list) else data["video"]
    assert _same_pixels(sent_image, image) and torch.equal(sent_video, video)
    assert out["multi_modal_uuids"]["image"][0].endswith(HASHER.content_key("image", image))


@pytest.mark.parametrize("pillow", ["11.1, no fromarrow", "12.3, fromarrow unsafe"])
def test_without_pillows_fromarrow_a_changed_rgb_hand_out_is_not_pristine(
    store: str, pillow: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pillow before 11.2 has no fromarrow; before 13 its Arrow export of an image over a
    # borrowed buffer kills the process (python-pillow/Pillow issue 9896, seen on 12.3.0).
    # Either way an RGB store is packed and each hand-out is a copy of it, which no page
    # check can watch: such a hand-out is never taken as pristine.
    import PIL

    if pillow.startswith("11.1"):
        monkeypatch.delattr(Image, "fromarrow")
    else:  # the road that crashed is not taken: fromarrow is never called
        monkeypatch.setattr(PIL, "__version__", "12.3.0")
        monkeypatch.setattr(Image, "fromarrow", _never_called)
    image = _image()
    record = TextPrompt(prompt="<image>", multi_modal_data={"image": image})
    assert _same_pixels(record.multi_modal_data["image"][0], image)
    assert _sent(record)[0] == _fresh_key("image", image)
    _, sent = _sent(record)
    sent.paste((0, 0, 0), (0, 0, SIDE, SIDE))
    assert not sent.pristine() and _same_pixels(sent.copy(), sent)
    assert _same_pixels(_sent(TextPrompt(prompt="<image>", multi_modal_data={"image": sent}))[1], sent)


def _never_called(*args: object, **kwargs: object) -> None:
    raise AssertionError("Image.fromarrow called where Pillow cannot export a borrowed image")


def test_a_palette_put_on_a_hand_outs_core_is_seen(store: str) -> None:
    # putpalette on the core turns an "L" core into "P" in place: the same core object,
    # no page written, but Pillow (and vLLM's convert) now reads through the palette. Not
    # the seal, and no image a record takes: an "L" image holding P pixels is refused by
    # name (vLLM's parser copies it into a P image; test_records.py).
    _, sent = _sent(TextPrompt(prompt="<image>", multi_modal_data={"image": _image(mode="L")}))
    sent.im.putpalette("RGB", "RGB", bytes([255, 0, 0]) * 256)
    assert not sent.pristine()
    with pytest.raises(PromptTypeError, match="Pillow holds its pixels as 'P'"):
        TextPrompt(prompt="<image>", multi_modal_data={"image": sent})


def test_a_view_compares_with_a_file_image_as_pillows_own_copy_does() -> None:
    data = io.BytesIO()
    _image().save(data, "PNG")
    png = Image.open(io.BytesIO(data.getvalue()))
    view = TextPrompt(prompt="x", multi_modal_data={"image": png}).multi_modal_data["image"][0]
    assert (view == png) is (png == view) is (png.copy() == png) is False
    assert view == png.copy() and _same_pixels(view, png)


TENSOR_SHAPES: dict[str, Callable[[], Any]] = {
    "bfloat16": lambda: torch.arange(600_000, dtype=torch.float32).reshape(100, 6000).to(torch.bfloat16),
    "bool": lambda: torch.arange(2_000_000).reshape(1000, 2000) % 3 == 0,
    "complex64": lambda: torch.randn(300, 600, dtype=torch.complex64),
    "transposed": lambda: torch.randn(400, 700).T,
    "channels_last": lambda: torch.randn(2, 3, 300, 300).to(memory_format=torch.channels_last),
    "offset": lambda: torch.randn(900, 900)[3:, 5:],
    "0-d": lambda: torch.tensor(-0.0),
    "one element, stride 2": lambda: torch.tensor([-0.0, 1.0])[::2],
    "int16, small": lambda: torch.arange(30, dtype=torch.int16).reshape(5, 6),
}


@pytest.mark.parametrize("make", list(TENSOR_SHAPES.values()), ids=list(TENSOR_SHAPES))
def test_a_sealed_tensor_holds_its_values_in_any_dtype_and_layout(
    store: str, make: Callable[[], Any]
) -> None:
    tensor = make()
    modality = "video" if tensor.ndim >= 2 else "sensor"  # a 0-d tensor is a number, a 1-D one no video
    record = TextPrompt(prompt="<video>", multi_modal_data={modality: [tensor]})
    key, sent = _sent(record, modality)
    assert sent.dtype == tensor.dtype and sent.shape == tensor.shape and torch.equal(sent, tensor)
    assert key == "stage0:rep0:" + HASHER.content_key(modality, tensor) == _fresh_key(modality, sent)


@contextlib.contextmanager
def _no_other_thread_may_run() -> Iterator[list[int]]:
    """Yields a list that a waiting thread appends to if the GIL is ever let go inside.

    With a switch interval longer than the test, only a call that releases the GIL (a
    blocking system call, most C code that copies) lets the waiting thread run. The cyclic
    collector is off inside: a collection there may finalize an earlier test's store, whose
    close lets go, and that says nothing about the code under test.
    """
    import gc
    import sys
    import threading
    import time

    go, ran = threading.Event(), []
    waiter = threading.Thread(target=lambda: (go.wait(), ran.append(1)))
    interval, collecting = sys.getswitchinterval(), gc.isenabled()
    gc.collect()
    gc.disable()
    sys.setswitchinterval(1000.0)  # first: the waiter's first wait for the GIL must be a long one
    try:
        waiter.start()  # it runs until it blocks in go.wait(), its first release
        go.set()  # it now waits for the GIL alone
        settled = time.perf_counter() + 0.005
        while time.perf_counter() < settled:  # holding the GIL while it wakes and queues for it
            pass
        yield ran
    finally:
        sys.setswitchinterval(interval)
        if collecting:
            gc.enable()
        waiter.join()


@pytest.mark.parametrize("kind", ["RGB image", "RGBA image", "tensor"])
def test_a_reused_record_sends_its_item_without_letting_the_gil_go(store: str, kind: str) -> None:
    # Beside a thread busy in Python each release costs up to a switch interval (5 ms)
    # before the GIL comes back: a reused request must make no system call that lets go.
    if kind == "RGB image" and not _rgb_hand_outs_are_mappings():
        pytest.skip("before Pillow 13 an RGB hand-out is a copy, and given back it is sealed again")
    modality = "video" if kind == "tensor" else "image"
    item = _tensor() if kind == "tensor" else _image(mode=kind.split()[0])
    record = TextPrompt(prompt="x", multi_modal_data={modality: [item]})
    sent = [_sent(record, modality) for _ in range(2)]  # keyed, and the hand-out road warm
    with _no_other_thread_may_run() as ran:
        for _ in range(20):
            sent.append(_sent(record, modality))
            if kind != "tensor":  # each hand-out let go of, unmapped (torch's own tensor
                del sent[0]  # deallocation sometimes lets go of the GIL: not ours to test)
        # An untouched hand-out given back: its pages are checked, not copied.
        given_back = TextPrompt(prompt="y", multi_modal_data={modality: [sent[-1][1]]})
        assert ran == [], "a reused record's hand-out let the GIL go"
    assert _sealed.seal_of(given_back.multi_modal_data[modality][0]) is _sealed.seal_of(
        record.multi_modal_data[modality][0]
    )
    assert len({key for key, _ in sent}) == 1


def test_under_a_file_size_limit_records_seal_into_private_bytes() -> None:
    # A memfd counts against RLIMIT_FSIZE (ulimit -f, systemd's LimitFSIZE): writing past
    # it fails with EFBIG, and the record takes a bytes store instead of failing.
    import resource

    if not _sealed._SEAL_ALL:
        pytest.skip("no sealed memfds on this system")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 19, hard))  # 512 KiB; the image is 1.6 MB
    try:
        image, tensor = _image(), _tensor()
        record = TextPrompt(prompt="x", multi_modal_data={"image": image, "video": tensor})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    for modality, item in (("image", image), ("video", tensor)):
        assert _sealed.seal_of(record.multi_modal_data[modality][0])._fd is None
        key, sent = _sent(record, modality)
        assert key == _fresh_key(modality, item) == _fresh_key(modality, sent)


def test_without_memfd_create_in_libc_records_seal_into_bytearrays() -> None:
    # glibc before 2.27 has no memfd_create: importing must still work, and every store is
    # a private bytearray (each hand-out a copy), with the same keys and the same guarantee.
    import subprocess
    import sys

    code = """
import ctypes
class NoMemfd(ctypes.PyDLL):
    def __getattr__(self, name):
        if name == "memfd_create":
            raise AttributeError(name)
        return super().__getattr__(name)
ctypes.PyDLL = NoMemfd
import numpy as np
from PIL import Image
from omni_requests import MediaHasher, TextPrompt, _sealed, scope_to_replica
from omni_requests_vllm import to_vllm
assert _sealed._LIBC is None and _sealed._SEAL_ALL == 0
def original():
    return Image.fromarray(np.random.default_rng(1).integers(0, 256, (640, 640, 3), dtype=np.uint8))
image, hasher = original(), MediaHasher("m")
record = TextPrompt(prompt="x", multi_modal_data={"image": image})
view = record.multi_modal_data["image"][0]
assert _sealed.seal_of(view)._fd is None  # 1.6 MB: a mapped store, had there been memfds
view.putpixel((0, 0), (1, 2, 3))
image.putpixel((1, 1), (4, 5, 6))
sent = to_vllm(scope_to_replica(record, 0, hasher=hasher))
assert sent["multi_modal_uuids"]["image"][0] == "stage0:rep0:" + hasher.content_key("image", original())
assert sent["multi_modal_data"]["image"][0].tobytes() == original().tobytes()
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


# EXIF tags set through getexif() live in Pillow's cache on the image, not in its info.
# vLLM's parser reads two: the orientation and the ImageID.
EXIF_EDITS: dict[str, Callable[[Any], None]] = {
    "orientation set": lambda image: image.getexif().__setitem__(EXIF_ORIENTATION, 6),
    "ImageID set": lambda image: image.getexif().__setitem__(EXIF_IMAGE_ID, uuid.UUID(int=7)),
    "orientation deleted": lambda image: image.getexif().__delitem__(EXIF_ORIENTATION),
}


def _tagged(orientation: int = 3, mode: str = "RGB") -> Image.Image:
    """An image whose info holds an EXIF orientation, as a decoded JPEG's does."""
    image = _image(mode=mode)
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = orientation
    image.info["exif"] = exif.tobytes()
    return image


def _vllm_key(image: Any) -> str:
    """vLLM's own key of ``image`` as its parser hands it to the hasher: turned upright
    (a copy, which drops an ImageID set in memory) and in RGB."""
    vllm_hasher = pytest.importorskip("vllm.multimodal.hasher").MultiModalHasher
    parsed = ImageOps.exif_transpose(exif_view(image)).convert("RGB")  # the image left as it is
    return "stage0:rep0:" + vllm_hasher.hash_kwargs("blake3", model_id=HASHER.model_id, image=parsed)


def _parser_tags(image: Any) -> tuple[object, object]:
    exif = exif_of(image)  # the image left as it is
    return exif.get(EXIF_ORIENTATION), exif.get(EXIF_IMAGE_ID)


@pytest.mark.parametrize("edit", list(EXIF_EDITS), ids=list(EXIF_EDITS))
def test_an_exif_edit_on_a_view_is_a_change_that_new_records_and_scope_stage0_send(
    store: str, edit: str
) -> None:
    omni = pytest.importorskip("omni_requests_omni")
    record = TextPrompt(prompt="<image>", multi_modal_data={"image": _tagged()})
    first, sent = _sent(record)
    for target in (sent, record.multi_modal_data["image"][0]):
        EXIF_EDITS[edit](target)
        assert not target.pristine()
        tags, want = _parser_tags(target), _vllm_key(target)
        assert want == "stage0:rep0:" + HASHER.content_key("image", target)
        reused = TextPrompt(prompt="<image>", multi_modal_data={"image": target})
        pool = omni.Stage0Pool(replicas=2, select=lambda request: 0)
        dict_road = omni.scope_stage0(
            {"prompt": "<image>", "multi_modal_data": {"image": target}},
            pool=pool,
            hasher=HASHER,
            request_id="r",
        )[1]
        for out in (to_vllm(scope_to_replica(reused, 0, hasher=HASHER)), dict_road):
            key, again = out["multi_modal_uuids"]["image"][0], out["multi_modal_data"]["image"][0]
            assert _parser_tags(again) == tags and _same_pixels(again, target) and key == want
        # The new record sealed the edit: writes to its view, its hand-outs or the image
        # it was built from do not reach it, and its pickle keeps the edit.
        for written in (reused.multi_modal_data["image"][0], _sent(reused)[1], target):
            written.putpixel((0, 0), (1, 2, 3))
            written.getexif()[EXIF_ORIENTATION] = 8
        for copy in (reused, pickle.loads(pickle.dumps(reused))):
            key, again = _sent(copy)
            assert key == want and _parser_tags(again) == tags
        assert _sent(record)[0] == first  # the first record sends what it sealed


def test_exif_edits_vllm_does_not_read_leave_a_view_pristine_as_pillows_copy_drops_them(store: str) -> None:
    record = TextPrompt(prompt="<image>", multi_modal_data={"image": _tagged()})
    first, sent = _sent(record)
    sent.getexif()[0x010F] = threading.Lock()  # Make, with a value no deepcopy can copy
    sent.getexif().get_ifd(0x8769)[0x9003] = "2026:12:04"
    assert (
        sent.pristine() and _sent(TextPrompt(prompt="<image>", multi_modal_data={"image": sent}))[0] == first
    )


def test_an_untouched_hand_out_given_back_is_not_parsed_again(
    store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # from_vllm(to_vllm(record)): the hand-out is pristine, so it reads as its seal does;
    # its EXIF (which can be kilobytes) is not parsed to compare it with a new view.
    from omni_requests import _hashing

    record = TextPrompt(prompt="<image>", multi_modal_data={"image": _tagged(mode="RGBA")})
    first, sent = _sent(record)  # RGBA: a mapping with every Pillow (RGB is copied before 13)
    for name in ("_parsed_as", "_exif_image_id"):
        monkeypatch.setattr(_hashing, name, _never_called)
    again = TextPrompt(prompt="<image>", multi_modal_data={"image": sent})
    assert _sealed.seal_of(again.multi_modal_data["image"][0]) is sent._sealed[0]
    monkeypatch.undo()
    assert _sent(again)[0] == first


def _fake_exif(image: Any) -> Image.Exif:
    exif = Image.Exif()
    exif[EXIF_IMAGE_ID] = uuid.UUID(int=9)
    return exif


# Changes to a hand-out that its pixels, core, EXIF cache and == on info do not show.
UNSEEN_CHANGES: dict[str, Callable[[Any], None]] = {
    "transparency 5 made 5.0": lambda image: image.info.__setitem__("transparency", 5.0),
    "getexif replaced on the image": lambda image: setattr(image, "getexif", lambda: _fake_exif(image)),
}


@pytest.mark.parametrize("change", list(UNSEEN_CHANGES), ids=list(UNSEEN_CHANGES))
def test_a_hand_out_changed_where_equality_cannot_see_is_not_pristine(store: str, change: str) -> None:
    # The untouched road takes the seal without a parse; these changes make vLLM's parser
    # read the image otherwise (5.0 raises in its convert), so they must leave that road.
    image = _tagged(mode="L")
    image.info["transparency"] = 5
    record = TextPrompt(prompt="<image>", multi_modal_data={"image": image})
    first, sent = _sent(record)
    UNSEEN_CHANGES[change](sent)
    assert not sent.pristine()
    try:
        want: object = "stage0:rep0:" + MediaHasher(HASHER.model_id).content_key("image", sent)
    except Exception:  # noqa: BLE001 - where the hasher fails, the record refuses the item by name
        want = InvalidPromptError
    try:
        got: object = _sent(TextPrompt(prompt="<image>", multi_modal_data={"image": sent}))[0]
    except Exception as error:  # noqa: BLE001
        got = type(error)
    assert got == want != first
    assert _sent(record)[0] == first


def test_a_mutable_tag_value_is_the_records_own(store: str) -> None:
    # An ImageID may be any object (vLLM keys only a UUID); a list set through getexif()
    # is copied into the seal and into each hand-out, so changing one changes no other.
    image = _image()
    image.getexif()[EXIF_IMAGE_ID] = ["scan", 1]
    record = TextPrompt(prompt="<image>", multi_modal_data={"image": image})
    image.getexif()[EXIF_IMAGE_ID].append("caller")
    sent = _sent(record)[1]
    sent.getexif()[EXIF_IMAGE_ID].append("engine")
    assert _sent(record)[1].getexif()[EXIF_IMAGE_ID] == ["scan", 1]
    assert record.multi_modal_data["image"][0].getexif()[EXIF_IMAGE_ID] == ["scan", 1]


def test_file_images_whose_exif_pillow_parsed_at_open_are_sealed() -> None:
    # A JPEG's dpi is read from its EXIF when it is opened (Pillow's cache is filled), and
    # a resolution of 0/0 is NaN, which equals nothing: still no edit.
    exif = Image.Exif()
    exif[EXIF_ORIENTATION], exif[0x011A], exif[0x0128] = 6, IFDRational(0, 0), 2
    data = io.BytesIO()
    _image().save(data, "JPEG", exif=exif, quality=95)
    jpeg = Image.open(io.BytesIO(data.getvalue()))
    want = _vllm_key(jpeg)
    record = TextPrompt(prompt="<image>", multi_modal_data={"image": jpeg})
    assert _sealed.seal_of(record.multi_modal_data["image"][0]) is not None
    jpeg.paste((0, 0, 0), (0, 0, 8, 8))
    key, sent = _sent(record)
    assert key == want and _parser_tags(sent)[0] == 6


def test_a_tiff_keeps_its_exif_after_being_hashed() -> None:
    # Loading a TIFF turns it upright by the EXIF it reads from the file into Pillow's
    # cache, then closes the file: that cache is the only copy left, and stays.
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = 6
    data = io.BytesIO()
    _image().save(data, "TIFF", tiffinfo=exif)
    want = _vllm_key(Image.open(io.BytesIO(data.getvalue())))
    for look in (
        lambda image: HASHER.content_key("image", image),
        lambda image: TextPrompt(prompt="<image>", multi_modal_data={"image": image}),
        lambda image: wire.encode(TextPrompt(prompt="<image>", multi_modal_data={"image": image})),
    ):
        tiff = Image.open(io.BytesIO(data.getvalue()))
        look(tiff)
        assert isinstance(tiff.getexif(), Image.Exif) and _vllm_key(tiff) == want


def scope_stage0_of(image: Any) -> Any:
    omni = pytest.importorskip("omni_requests_omni")
    pool = omni.Stage0Pool(replicas=2, select=lambda request: 0)
    given = {"prompt": "<image>", "multi_modal_data": {"image": image}}
    return omni.scope_stage0(given, pool=pool, hasher=HASHER, request_id="r")


@pytest.mark.parametrize(
    "look",
    [
        lambda image: HASHER.key("image", image),
        lambda image: HASHER.content_key("image", image),
        lambda image: TextPrompt(prompt="<image>", multi_modal_data={"image": image}),
        lambda image: wire.encode(TextPrompt(prompt="<image>", multi_modal_data={"image": image})),
        lambda image: scope_stage0_of(image),
        lambda image: (testing._snapshot(image), testing._copy_media(image)),
    ],
    ids=["key", "content_key", "record", "wire", "scope_stage0", "testing"],
)
def test_looking_at_a_callers_image_leaves_its_exif_to_be_read_afresh(look: Callable[[Any], Any]) -> None:
    # Pillow keeps what getexif() parsed on the image and never reads info again: had we
    # filled that cache, tags the caller sets in info afterwards would not reach vLLM.
    image = _image()
    look(image)
    tagged = Image.new("RGB", (1, 1))
    tagged.getexif()[EXIF_ORIENTATION] = 6
    image.info["exif"] = tagged.getexif().tobytes()
    assert image.getexif().get(EXIF_ORIENTATION) == 6
    assert "stage0:rep0:" + HASHER.content_key("image", image) == _vllm_key(image) != _vllm_key(_image())


def test_an_image_with_exif_edited_in_memory_is_kept_as_given_with_its_tags(store: str) -> None:
    image = _image()
    image.getexif()[EXIF_ORIENTATION] = 6
    record = TextPrompt(prompt="<image>", multi_modal_data={"image": image})
    key, sent = _sent(record)
    assert sent.getexif().get(EXIF_ORIENTATION) == 6 and key == _vllm_key(image)
