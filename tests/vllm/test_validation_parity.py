"""``from_vllm`` accepts what vLLM accepts and refuses what it refuses, except where listed.

A Hypothesis strategy draws valid prompt dicts for a real model (Qwen2-VL: images and
videos; Qwen2-Audio: audio): text or token prompts, one placeholder per item, items
given singly or in lists, UUIDs absent, bare, or lists mixing ``str`` and ``None``,
processor and media-io options, cache salts. Each test example then applies one
*mutation* (or none) with a stated outcome: whether vLLM's input boundary takes it
(``parse_model_prompt``, ``render_cmpl``, ``InputProcessor.process_inputs``) and which of
our errors ``from_vllm`` raises, at which field path. Both sides are checked against that
outcome on every example, and wherever both accept, ``to_vllm(from_vllm(d))`` must
render exactly like ``d``: same token ids, keys, placeholders and processed tensors.

Where the outcomes differ, the difference is deliberate and listed in ``DIVERGENCES``;
a test checks that the list names exactly the mutations whose outcomes differ, so a
change in vLLM's behaviour (or ours) shows up here.
"""

from __future__ import annotations

import pytest
from _tiny_models import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from collections.abc import Callable
from typing import Any, Literal

import _tiny_models as tm
import attrs
import numpy as np
import torch
from _engine import assert_same_engine_input, render, through_boundary
from _tiny_models import TinyModel
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from omni_requests import InvalidPromptError, OmniRequestsError, PromptTypeError
from omni_requests_vllm import from_vllm, to_vllm

pytestmark = pytest.mark.vllm

MODELS = ("qwen2_vl", "qwen2_audio")

# -- outcomes --


@attrs.frozen
class Outcome:
    """What should happen to a prompt dict: at vLLM's boundary, and in ``from_vllm``."""

    vllm_accepts: bool
    error: type[OmniRequestsError] | None = None
    """Our error class, or None where ``from_vllm`` accepts."""
    path: str | None = None

    @property
    def we_accept(self) -> bool:
        return self.error is None


ACCEPTED = Outcome(vllm_accepts=True)


def refused(error: type[OmniRequestsError], path: str) -> Outcome:
    """Both refuse it; our error names the field."""
    return Outcome(False, error, path)


def stricter(error: type[OmniRequestsError], path: str) -> Outcome:
    """vLLM takes it, we refuse it (a deliberate divergence)."""
    return Outcome(True, error, path)


OUT_OF_REACH = Outcome(vllm_accepts=False)
"""vLLM refuses it for a reason a record cannot know (a deliberate divergence)."""


@attrs.frozen
class Divergence:
    kind: Literal["stricter", "model-dependent", "normalised"]
    why: str


DIVERGENCES: dict[str, Divergence] = {
    # We refuse what vLLM takes.
    "unknown_field": Divergence(
        "stricter",
        "vLLM ignores keys it does not know, so a typo ('multi_modal_uuid') drops the UUIDs silently",
    ),
    "empty_uuid": Divergence("stricter", "'' would be one cache key for every item given it"),
    "scoped_uuid": Divergence(
        "stricter", "a 'stage0:rep1:...' UUID comes from an engine's copy; scoping it again stacks prefixes"
    ),
    "policy_prefixed_uuid": Divergence(
        "stricter", "'tenant:acme:cat' or 'bound:...' would spell a key policy's key, another tenant's"
    ),
    "non_str_uuid_with_options": Divergence(
        "stricter", "with processor or media-io options vLLM hashes any UUID object; a key must be a str"
    ),
    "one_uuid_two_items": Divergence(
        "stricter", "vLLM keys items by their UUID alone: the second item is served the first's features"
    ),
    "uuid_modality_not_str": Divergence("stricter", "vLLM ignores UUID-only modalities, whatever their name"),
    "token_ids_as_raw_bytes": Divergence(
        "stricter", "vLLM reads bytes or a bytearray as ints; raw bytes are no token ids"
    ),
    "token_id_bool_or_float": Divergence(
        "stricter", "vLLM takes True and 2.0 as token ids; a record keeps ints"
    ),
    "prompt_not_str_beside_tokens": Divergence(
        "stricter", "vLLM checks 'prompt' only when there are no token ids, then passes it on as it is"
    ),
    "cache_salt_not_str": Divergence("stricter", "vLLM passes any truthy cache salt on"),
    "audio_rate_not_a_number": Divergence(
        "stricter",
        "vLLM compares an audio's rate to the model's as float(rate): '16000' or a 0-d array passes "
        "when it equals it, and fails in resampling when it does not",
    ),
    "audio_samples_not_numbers": Divergence(
        "stricter",
        "a feature extractor reads numeric text, dates or a one-field record array as float32 "
        "samples, and fails on other text or records after routing; records ask for numbers",
    ),
    "media_io_value_not_mapping": Divergence("stricter", "vLLM only hashes these options, whatever they are"),
    "bad_options_without_media": Divergence(
        "stricter", "vLLM never reads multi_modal_uuids or media options when there are no media"
    ),
    # vLLM refuses what we take: it depends on the model or the deployment, which a record does not know.
    "unsupported_modality": Divergence(
        "model-dependent", "the model's parser decides its modalities; records take any name"
    ),
    "placeholder_count_mismatch": Divergence("model-dependent", "placeholders are the model's tokens"),
    "cached_only_item_not_cached": Divergence(
        "model-dependent", "a None item is served from the processor cache, which this renderer has off"
    ),
    "token_id_out_of_vocab": Divergence("model-dependent", "the vocabulary is the model's"),
    "audio_waveform_a_list_with_its_rate": Divergence(
        "model-dependent",
        "vLLM's parser reads the ndim of (waveform, rate)'s waveform only for a model that sets "
        "target_channels (Qwen2-Audio) or when it resamples; others (Gemma 3n, Granite Speech) take a list",
    ),
    "empty_prompt": Divergence("model-dependent", "vLLM refuses an empty decoder prompt"),
    "prompt_embeds_disabled": Divergence("model-dependent", "embeddings need --enable-prompt-embeds"),
    "encoder_decoder_prompt": Divergence("model-dependent", "this model is decoder-only"),
    # We take it and hand vLLM what it takes.
    "token_ids_numpy": Divergence(
        "normalised",
        "vLLM fails on an ndarray of token ids; a record stores a list of ints",
    ),
}
"""Every place where ``from_vllm`` and vLLM's boundary disagree, and why."""


# -- valid prompts --


@attrs.define
class Case:
    """A drawn prompt dict, with what it was built from (mutations edit ``prompt``)."""

    model: TinyModel
    tokenizer: Any
    prompt: Any
    counts: dict[str, int]
    kind: Literal["text", "tokens"]
    bare: set[str]
    """Modalities whose one item is given by itself, not in a list."""

    @property
    def data(self) -> dict[str, Any]:
        data: dict[str, Any] = self.prompt.setdefault("multi_modal_data", {})
        return data

    @property
    def uuids(self) -> dict[Any, Any]:
        uuids: dict[Any, Any] = self.prompt.setdefault("multi_modal_uuids", {})
        return uuids

    def items(self, modality: str) -> list[Any]:
        """The modality's items as a list in the prompt (a single item is wrapped)."""
        if modality in self.bare:
            self.data[modality] = [self.data[modality]]
            self.bare.discard(modality)
        items: list[Any] = self.data[modality]
        return items

    def uuid_list(self, modality: str) -> list[Any]:
        """The modality's UUIDs as a list in the prompt (created as all None)."""
        given = self.uuids.get(modality)
        if given is None:
            given = [None] * self.counts[modality]
        elif isinstance(given, str):
            given = [given]
        self.uuids[modality] = given = list(given)
        return given

    def fresh_uuid(self, draw: st.DrawFn) -> str:
        """A UUID no item of the prompt has: records refuse one UUID over two items."""
        taken = {u for row in self.uuids.values() for u in ([row] if isinstance(row, str) else row)}
        return draw(_uuid_text.filter(lambda u: u not in taken))

    def drop_hash_factors(self) -> None:
        self.prompt.pop("mm_processor_kwargs", None)
        self.prompt.pop("media_io_kwargs", None)


class _MediaSource:
    """Where pixels and samples come from: a generator that ``cases`` seeds from a draw at
    the start of each example. An example's media then follow from its draws alone, so
    Hypothesis replays and shrinks it exactly, a new mutation shifts no other mutation's
    data, and items drawn within one example still differ from each other (one stream)."""

    generator = np.random.default_rng(0)


def _rng() -> np.random.Generator:
    return _MediaSource.generator


_pixels = st.sampled_from([(28, 28), (28, 56), (56, 28)]).map(
    lambda hw: _rng().integers(0, 256, (*hw, 3), dtype=np.uint8)
)
_frames = st.sampled_from([2, 4]).map(lambda n: _rng().integers(0, 256, (n, 28, 28, 3), dtype=np.uint8))
_wave = st.integers(400, 1600).map(lambda n: _rng().standard_normal(n).astype(np.float32))

MEDIA: dict[str, st.SearchStrategy[Any]] = {
    "image": st.one_of(_pixels, _pixels.map(Image.fromarray)),
    "video": st.one_of(_frames, _frames.map(list), _frames.map(lambda f: (f, {"fps": 2.0}))),
    "audio": st.one_of(
        _wave, _wave.map(lambda w: (w, 16000)), _wave.map(lambda w: [float(x) for x in w[:400]])
    ),
}
POLICY_PREFIXES = ("tenant:", "user:", "bound:")
# Valid UUIDs: none spells an engine's scope or a key policy's parts (see the mutations).
_uuid_text = st.text(min_size=1, max_size=12).filter(lambda s: not s.startswith(("stage", *POLICY_PREFIXES)))


@st.composite
def cases(
    draw: st.DrawFn,
    model: TinyModel,
    tokenizer: Any,
    *,
    min_items: int = 0,
    media: bool = True,
    kind: Literal["text", "tokens"] | None = None,
) -> Case:
    """A valid prompt for ``model``; ``min_items`` in at least one modality."""
    _MediaSource.generator = np.random.default_rng(draw(st.integers(0, 2**32 - 1), label="media seed"))
    counts = {m: draw(st.integers(0, 2)) for m in model.modalities} if media else {}
    if min_items:
        chosen = draw(st.sampled_from(model.modalities))
        counts[chosen] = max(counts[chosen], min_items)
    data: dict[str, Any] = {}
    uuids: dict[str, Any] = {}
    bare: set[str] = set()
    taken: set[str] = set()  # one UUID names one item (see one_uuid_two_items)
    fresh = _uuid_text.filter(lambda u: u not in taken)
    for modality, count in counts.items():
        if count == 0:
            if draw(st.booleans()):
                data[modality] = []
            continue
        items = [draw(MEDIA[modality]) for _ in range(count)]
        if count == 1 and draw(st.booleans()):
            data[modality] = items[0]
            bare.add(modality)
        else:
            data[modality] = items
        form = draw(
            st.sampled_from(["none", "list", "tuple", "bare"] if count == 1 else ["none", "list", "tuple"])
        )
        if form == "bare":
            uuids[modality] = draw(fresh)
            taken.add(uuids[modality])
        elif form != "none":
            given = []
            for _ in range(count):
                given.append(draw(st.none() | fresh))
                taken.add(given[-1])
            uuids[modality] = given if form == "list" else tuple(given)
    text = model.prompt(**counts)
    kind = kind or draw(st.sampled_from(["text", "tokens"]))
    prompt: dict[str, Any] = {"prompt": text}
    if kind == "tokens":
        prompt = {"prompt_token_ids": list(tokenizer(text)["input_ids"])}
        if draw(st.booleans()):
            prompt["prompt"] = text
    if data or draw(st.booleans()):
        prompt["multi_modal_data"] = data
    if uuids:
        prompt["multi_modal_uuids"] = uuids
    if draw(st.booleans()):
        prompt["cache_salt"] = draw(st.text(min_size=1, max_size=8))
    if data and draw(st.booleans()):
        prompt["media_io_kwargs"] = {m: {"num_frames": 2} for m in data}
    if "image" in data and draw(st.booleans()):
        prompt["mm_processor_kwargs"] = {"size": {"shortest_edge": 28 * 28, "longest_edge": 56 * 56}}
    return Case(model, tokenizer, prompt, counts, kind, bare)


# -- mutations: one edit of a valid prompt, with its outcome --

Mutation = Callable[[st.DrawFn, Case], Outcome]
MUTATIONS: dict[str, tuple[dict[str, Any], Mutation]] = {}
"""name -> (what the valid prompt needs, the edit)."""


def mutation(**needs: Any) -> Callable[[Mutation], Mutation]:
    def register(edit: Mutation) -> Mutation:
        MUTATIONS[edit.__name__] = (needs, edit)
        return edit

    return register


def _models(needs: dict[str, Any]) -> tuple[tuple[str, ...], dict[str, Any]]:
    """The models a mutation applies to (``model=`` among its needs: one), and the rest of its needs."""
    rest = dict(needs)
    model = rest.pop("model", None)
    return (MODELS if model is None else (model,)), rest


def _modality(draw: st.DrawFn, case: Case, at_least: int = 1) -> str:
    return draw(st.sampled_from(sorted(m for m, n in case.counts.items() if n >= at_least)))


@mutation()
def valid(draw: st.DrawFn, case: Case) -> Outcome:
    return ACCEPTED


# Both refuse.


@mutation(min_items=1)
def uuids_wrong_length(draw: st.DrawFn, case: Case) -> Outcome:
    m = _modality(draw, case)
    count = case.counts[m]
    length = draw(st.sampled_from([n for n in (0, count - 1, count + 1, count + 2) if n >= 0 and n != count]))
    case.uuids[m] = [draw(st.none() | _uuid_text) for _ in range(length)]
    return refused(InvalidPromptError, f"$.multi_modal_uuids.{m}")


@mutation(min_items=2)
def bare_uuid_for_several_items(draw: st.DrawFn, case: Case) -> Outcome:
    m = _modality(draw, case, 2)
    case.uuids[m] = draw(_uuid_text)
    return refused(InvalidPromptError, f"$.multi_modal_uuids.{m}")


@mutation(min_items=1)
def none_item_with_none_uuid(draw: st.DrawFn, case: Case) -> Outcome:
    m = _modality(draw, case)
    i = draw(st.integers(0, case.counts[m] - 1))
    case.items(m)[i] = None
    uuids = case.uuid_list(m)
    uuids[:] = [u if u is not None else "x" for u in uuids]  # only item i lacks one
    uuids[i] = None
    return refused(InvalidPromptError, f"$.multi_modal_uuids.{m}[{i}]")


@mutation(min_items=1)
def none_item_without_uuids(draw: st.DrawFn, case: Case) -> Outcome:
    # vLLM checks this only when UUIDs are given; without any it fails later, inside
    # the HF processor, with an error that names no field.
    m = _modality(draw, case)
    i = draw(st.integers(0, case.counts[m] - 1))
    case.items(m)[i] = None
    case.uuids.pop(m, None)
    return refused(InvalidPromptError, f"$.multi_modal_uuids.{m}[{i}]")


@mutation(min_items=1)
def none_value_without_uuids(draw: st.DrawFn, case: Case) -> Outcome:
    m = _modality(draw, case)
    case.data[m] = None
    case.uuids.pop(m, None)
    return refused(InvalidPromptError, f"$.multi_modal_data.{m}")


@mutation(min_items=1)
def non_str_uuid(draw: st.DrawFn, case: Case) -> Outcome:
    m = _modality(draw, case)
    i = draw(st.integers(0, case.counts[m] - 1))
    case.uuid_list(m)[i] = draw(st.sampled_from([5, 2.5, b"id"]))
    case.drop_hash_factors()  # vLLM then uses the UUID as the key and refuses a non-str one
    return refused(PromptTypeError, f"$.multi_modal_uuids.{m}[{i}]")


@mutation(min_items=1)
def embedding_fields_as_a_dict(draw: st.DrawFn, case: Case) -> Outcome:
    # vLLM's form for a model's embedding fields, split into items by the model. This
    # renderer has --enable-mm-embeds off, so vLLM refuses it too; with it on vLLM takes
    # it and a plain dict is still refused (only the model splits it into items; records
    # take its items as EmbeddingFields, built by the chat path: tests/vllm/test_chat_parity_audio.py).
    m = _modality(draw, case)
    case.data[m] = {f"{m}_embeds": torch.zeros(4, 64), "image_grid_thw": torch.tensor([[1, 4, 4]])}
    case.uuids.pop(m, None)
    return refused(PromptTypeError, f"$.multi_modal_data.{m}")


@mutation(min_items=1)
def uuids_of_a_modality_not_a_list(draw: st.DrawFn, case: Case) -> Outcome:
    m = _modality(draw, case)
    # (None is no UUIDs to vLLM, as to records: each item keyed by its content.)
    case.uuids[m] = draw(st.sampled_from([5, {"x"}, frozenset({"x", "y"})]))
    return refused(PromptTypeError, f"$.multi_modal_uuids.{m}")


@mutation(min_items=1)
def data_not_a_mapping(draw: st.DrawFn, case: Case) -> Outcome:
    m = _modality(draw, case)
    case.prompt["multi_modal_data"] = list(case.items(m))
    return refused(PromptTypeError, "$.multi_modal_data")


@mutation(min_items=1)
def uuids_not_a_mapping(draw: st.DrawFn, case: Case) -> Outcome:
    case.prompt["multi_modal_uuids"] = draw(st.sampled_from([["x"], "x", 5]))
    return refused(PromptTypeError, "$.multi_modal_uuids")


@mutation()
def modality_name_not_str(draw: st.DrawFn, case: Case) -> Outcome:
    case.data[draw(st.sampled_from([0, 7, None]))] = np.zeros((28, 28, 3), np.uint8)
    return refused(PromptTypeError, "$.multi_modal_data")


@mutation(kind="text")
def prompt_not_str(draw: st.DrawFn, case: Case) -> Outcome:
    case.prompt["prompt"] = draw(st.sampled_from([5, None, b"what", ["what"]]))
    return refused(PromptTypeError, "$.prompt")


@mutation(kind="tokens")
def token_ids_not_a_list(draw: st.DrawFn, case: Case) -> Outcome:
    case.prompt["prompt_token_ids"] = draw(st.sampled_from(["what is", 5]))
    return refused(PromptTypeError, "$.prompt_token_ids")


@mutation(kind="tokens")
def token_id_not_int(draw: st.DrawFn, case: Case) -> Outcome:
    ids = case.prompt["prompt_token_ids"]
    i = draw(st.integers(0, len(ids) - 1))
    ids[i] = draw(st.sampled_from(["what", None, [1]]))
    return refused(PromptTypeError, f"$.prompt_token_ids[{i}]")


@mutation()
def no_prompt_field(draw: st.DrawFn, case: Case) -> Outcome:
    case.prompt.pop("prompt", None)
    case.prompt.pop("prompt_token_ids", None)
    return refused(InvalidPromptError, "$")


@mutation()
def not_a_prompt(draw: st.DrawFn, case: Case) -> Outcome:
    case.prompt = draw(st.sampled_from([5, None, b"what", ("what",), 2.5]))
    return refused(PromptTypeError, "$")


@mutation(min_items=1)
def processor_kwargs_not_a_mapping(draw: st.DrawFn, case: Case) -> Outcome:
    case.prompt["mm_processor_kwargs"] = draw(st.sampled_from([[1], "size", 5]))
    return refused(PromptTypeError, "$.mm_processor_kwargs")


@mutation(min_items=1)
def media_io_kwargs_not_a_mapping(draw: st.DrawFn, case: Case) -> Outcome:
    case.prompt["media_io_kwargs"] = draw(st.sampled_from([[1], "video", 5]))
    return refused(PromptTypeError, "$.media_io_kwargs")


def _bad_item(draw: st.DrawFn, case: Case, modality: str, bad: object) -> int:
    """Puts ``bad`` among the prompt's items of ``modality`` (as the only one where it has
    none: vLLM then refuses the placeholder count too); its index."""
    if case.counts.get(modality, 0) >= 1:
        i = draw(st.integers(0, case.counts[modality] - 1))
        case.items(modality)[i] = bad
        return i
    case.data[modality] = [bad]
    case.uuids.pop(modality, None)
    return 0


@mutation()
def image_item_a_container(draw: st.DrawFn, case: Case) -> Outcome:
    # vLLM's parser passes a dict, or a list of numbers, on as an image; the model's
    # processor fails on it, with an error that names no field. Records refuse it by name.
    # (A list of images is the model's to read: Qwen2-VL's processor flattens it.)
    pixels = np.zeros((28, 28, 3), np.uint8)
    bad = draw(st.sampled_from([pixels.tolist(), [], (1, 2), {"pixels": pixels}]))
    return refused(PromptTypeError, f"$.multi_modal_data.image[{_bad_item(draw, case, 'image', bad)}]")


@mutation()
def image_item_without_pixels(draw: st.DrawFn, case: Case) -> Outcome:
    bad = draw(
        st.sampled_from(
            [
                Image.new("RGB", (0, 28)),
                Image.new("RGB", (28, 0)),
                np.zeros((0, 28, 3), np.uint8),
                torch.zeros(28, 0, 3),
            ]
        )
    )
    return refused(InvalidPromptError, f"$.multi_modal_data.image[{_bad_item(draw, case, 'image', bad)}]")


@mutation(model="qwen2_vl")
def video_without_pixels(draw: st.DrawFn, case: Case) -> Outcome:
    # The model's processor fails on a video of no frames or of empty frames, naming no field.
    bad = draw(st.sampled_from([np.zeros((0, 28, 28, 3), np.uint8), np.zeros((2, 28, 0, 3), np.uint8), []]))
    return refused(InvalidPromptError, f"$.multi_modal_data.video[{_bad_item(draw, case, 'video', bad)}]")


@mutation(model="qwen2_audio", min_items=1)
def audio_without_samples(draw: st.DrawFn, case: Case) -> Outcome:
    i = draw(st.integers(0, case.counts["audio"] - 1))
    bad = draw(st.sampled_from([np.zeros(0, np.float32), (np.zeros(0, np.float32), 16000)]))
    case.items("audio")[i] = bad
    return refused(
        InvalidPromptError, f"$.multi_modal_data.audio[{i}]" + ("[0]" if isinstance(bad, tuple) else "")
    )


@mutation()
def image_item_of_too_few_dimensions(draw: st.DrawFn, case: Case) -> Outcome:
    # vLLM's parser passes a 1-D or 2-D array item on as an image (and splits a 2-D array
    # given whole into 1-D rows); the model's processor fails on it, naming no field.
    bad = draw(
        st.sampled_from([np.zeros((28, 28), np.uint8), np.zeros(28 * 28 * 3, np.uint8), torch.zeros(28)])
    )
    return refused(PromptTypeError, f"$.multi_modal_data.image[{_bad_item(draw, case, 'image', bad)}]")


@mutation()
def media_array_of_no_numbers(draw: st.DrawFn, case: Case) -> Outcome:
    # Strings, bytes, datetimes or records as pixels: the model's processor fails on them.
    dtype = draw(st.sampled_from(["<U1", "S1", "M8[s]", "m8[s]", [("a", "u1")]]))
    bad = np.zeros((28, 28, 3), dtype)
    return refused(PromptTypeError, f"$.multi_modal_data.image[{_bad_item(draw, case, 'image', bad)}]")


@mutation(model="qwen2_vl")
def video_item_of_too_few_dimensions(draw: st.DrawFn, case: Case) -> Outcome:
    # A 2-D array (a 3-D one given whole splits into them), or frames that are 2-D: the
    # model's processor fails on the video, naming no field.
    gray = np.zeros((28, 28), np.uint8)
    bad: object = draw(st.sampled_from(["video", "frames"]))
    i = _bad_item(draw, case, "video", gray if bad == "video" else [gray, gray])
    return refused(PromptTypeError, f"$.multi_modal_data.video[{i}]" + ("[0]" if bad == "frames" else ""))


@mutation(model="qwen2_audio", min_items=1)
def audio_item_no_waveform(draw: st.DrawFn, case: Case) -> Outcome:
    # vLLM's parser fails on a dict or an image as an audio item, or as the waveform of
    # (waveform, rate), naming no field.
    i = draw(st.integers(0, case.counts["audio"] - 1))
    bad = draw(st.sampled_from([{"waveform": draw(_wave)}, Image.new("L", (28, 28))]))
    if draw(st.booleans()):
        case.items("audio")[i] = (bad, 16000)
        return refused(PromptTypeError, f"$.multi_modal_data.audio[{i}][0]")
    case.items("audio")[i] = bad
    return refused(PromptTypeError, f"$.multi_modal_data.audio[{i}]")


@mutation(model="qwen2_audio", min_items=1)
def audio_rate_not_positive(draw: st.DrawFn, case: Case) -> Outcome:
    # vLLM resamples (waveform, rate) to the model's rate; its resamplers (torchaudio,
    # scipy, soxr, pyav) all fail on these, with errors that name no field.
    i = draw(st.integers(0, case.counts["audio"] - 1))
    rate = draw(st.sampled_from([0, 0.0, -16000, -1.5, np.float32(0), np.nan, np.inf, -np.inf]))
    case.items("audio")[i] = (draw(_wave), rate)
    return refused(InvalidPromptError, f"$.multi_modal_data.audio[{i}][1]")


# We refuse what vLLM takes (see DIVERGENCES).


@mutation(model="qwen2_audio", min_items=1)
def audio_rate_not_a_number(draw: st.DrawFn, case: Case) -> Outcome:
    i = draw(st.integers(0, case.counts["audio"] - 1))
    case.items("audio")[i] = (draw(_wave), draw(st.sampled_from(["16000", np.array(16000.0)])))
    return stricter(PromptTypeError, f"$.multi_modal_data.audio[{i}][1]")


@mutation(model="qwen2_audio", min_items=1)
def audio_samples_not_numbers(draw: st.DrawFn, case: Case) -> Outcome:
    # Numeric text, dates, a one-field record: Qwen2-Audio's feature extractor reads each
    # as float32 samples; other text or records it fails on.
    i = draw(st.integers(0, case.counts["audio"] - 1))
    # Rounded: a float32 sample as text can run past 12 characters ('-1.2345678e-05'),
    # and cut there it is no number (vLLM's outcome then turned on the random draw).
    wave = np.round(draw(_wave), 4)
    samples = draw(
        st.sampled_from(
            [
                wave.astype("U12"),
                wave.astype("S12"),
                (wave * 1000).astype("M8[s]"),
                np.rec.fromarrays([wave], names="a").view(np.ndarray),
            ]
        )
    )
    case.items("audio")[i] = samples
    return stricter(PromptTypeError, f"$.multi_modal_data.audio[{i}]")


@mutation()
def unknown_field(draw: st.DrawFn, case: Case) -> Outcome:
    name = draw(st.sampled_from(["multi_modal_uuid", "tenant", "mm_uuids", "images"]))
    case.prompt[name] = draw(st.sampled_from(["x", 1, {"image": ["x"]}]))
    return stricter(InvalidPromptError, f"$.{name}")


def _bad_uuid(draw: st.DrawFn, case: Case, value: str) -> Outcome:
    m = _modality(draw, case)
    i = draw(st.integers(0, case.counts[m] - 1))
    if case.counts[m] == 1 and draw(st.booleans()):
        case.uuids[m] = value
    else:
        case.uuid_list(m)[i] = value
    return stricter(InvalidPromptError, f"$.multi_modal_uuids.{m}[{i}]")


@mutation(min_items=1)
def empty_uuid(draw: st.DrawFn, case: Case) -> Outcome:
    return _bad_uuid(draw, case, "")


@mutation(min_items=1)
def scoped_uuid(draw: st.DrawFn, case: Case) -> Outcome:
    stage, replica = draw(st.integers(0, 3)), draw(st.integers(0, 3))
    return _bad_uuid(draw, case, f"stage{stage}:rep{replica}:{draw(_uuid_text)}")


@mutation(min_items=1)
def policy_prefixed_uuid(draw: st.DrawFn, case: Case) -> Outcome:
    return _bad_uuid(draw, case, draw(st.sampled_from(POLICY_PREFIXES)) + draw(st.just("") | _uuid_text))


@mutation(min_items=2)
def one_uuid_two_items(draw: st.DrawFn, case: Case) -> Outcome:
    # Two different items (the media strategies draw each from one stream per example),
    # of one modality or two, under one UUID: vLLM keys both by it, so the second is
    # served the first's features (tests/vllm/test_template_reuse.py).
    places = [(m, i) for m in case.data for i in range(case.counts.get(m, 0))]
    first, second = sorted(
        draw(st.lists(st.sampled_from(places), min_size=2, max_size=2, unique=True)), key=places.index
    )
    uuid = case.fresh_uuid(draw)
    for m, i in (first, second):
        case.uuid_list(m)[i] = uuid
    return stricter(InvalidPromptError, f"$.multi_modal_uuids.{second[0]}[{second[1]}]")


@mutation(min_items=1)
def none_value_with_uuids(draw: st.DrawFn, case: Case) -> Outcome:
    m = _modality(draw, case)
    case.uuid_list(m)[:] = [case.fresh_uuid(draw) for _ in range(case.counts[m])]
    case.data[m] = None
    return ACCEPTED  # vLLM drops the modality and its UUIDs (no item, no key); so does from_vllm


@mutation()
def text_or_bytes_as_media(draw: st.DrawFn, case: Case) -> Outcome:
    # vLLM's parser reads a str's characters, or a file's bytes, as items: its renderer
    # then refuses an image, its video and audio parsers fail. Records refuse it by name.
    m = draw(st.sampled_from(sorted({"image", *case.model.modalities})))
    text = draw(
        st.sampled_from(
            [
                "x",
                "cat.png",
                "data:image/png;base64,",
                b"\x89PNG\r\n",
                bytearray(b"RIFF"),
                memoryview(b"GIF8"),
            ]
        )
    )
    if case.counts.get(m):
        i = draw(st.integers(0, case.counts[m] - 1))
        case.items(m)[i] = text
        return refused(PromptTypeError, f"$.multi_modal_data.{m}[{i}]")
    case.data[m] = text
    return refused(PromptTypeError, f"$.multi_modal_data.{m}")


@mutation()
def video_tuple_vllm_cannot_unpack(draw: st.DrawFn, case: Case) -> Outcome:
    # A tuple other than a pair is a tuple of videos to vLLM's parser: three 3-D frames
    # fail its video processor (IndexError), and a video item that is a tuple other than
    # (frames, metadata) fails to unpack (ValueError). Records refuse both by name.
    frame = _rng().integers(0, 256, (28, 28, 3), dtype=np.uint8)
    if draw(st.booleans()):
        case.data["video"] = (frame, frame, frame)
        return refused(PromptTypeError, "$.multi_modal_data.video")
    video = _rng().integers(0, 256, (2, 28, 28, 3), dtype=np.uint8)
    case.data["video"] = [draw(st.sampled_from([(video,), (video, {"fps": 2.0}, 3)]))]
    return refused(PromptTypeError, "$.multi_modal_data.video[0]")


@mutation()
def audio_tuple_vllm_cannot_read(draw: st.DrawFn, case: Case) -> Outcome:
    # vLLM unpacks an audio tuple as (waveform, rate): other lengths fail there, and a str
    # or bytes waveform (a file's name or contents) fails its processor. Records refuse both.
    wave = _rng().standard_normal(800).astype(np.float32)
    item = draw(st.sampled_from([(wave, 16000, 1), (wave,), ("speech.wav", 16000), (b"RIFF", 16000)]))
    case.data["audio"] = [item]
    return refused(PromptTypeError, "$.multi_modal_data.audio[0]")


@mutation(min_items=1)
def non_str_uuid_with_options(draw: st.DrawFn, case: Case) -> Outcome:
    m = _modality(draw, case)
    i = draw(st.integers(0, case.counts[m] - 1))
    case.uuid_list(m)[i] = draw(st.sampled_from([5, 2.5, b"id"]))
    case.prompt["media_io_kwargs"] = {m: {"num_frames": 2}}
    return stricter(PromptTypeError, f"$.multi_modal_uuids.{m}[{i}]")


@mutation()
def uuid_modality_not_str(draw: st.DrawFn, case: Case) -> Outcome:
    case.uuids[draw(st.sampled_from([0, 7]))] = ["x"]
    return stricter(PromptTypeError, "$.multi_modal_uuids")


@mutation(kind="tokens")
def token_ids_as_raw_bytes(draw: st.DrawFn, case: Case) -> Outcome:
    # The tiny vocabularies fit in a byte, so the ids are the same numbers either way.
    ids = bytes(case.prompt["prompt_token_ids"])
    case.prompt["prompt_token_ids"] = draw(st.sampled_from([bytes, bytearray]))(ids)
    return stricter(PromptTypeError, "$.prompt_token_ids")


@mutation(kind="tokens", min_items=1)
def token_ids_as_a_memoryview(draw: st.DrawFn, case: Case) -> Outcome:
    # With media vLLM's renderer fails on a memoryview; without, it reads it as ints.
    case.prompt["prompt_token_ids"] = memoryview(bytes(case.prompt["prompt_token_ids"]))
    return refused(PromptTypeError, "$.prompt_token_ids")


@mutation(kind="tokens")
def token_id_bool_or_float(draw: st.DrawFn, case: Case) -> Outcome:
    ids = case.prompt["prompt_token_ids"]
    if draw(st.booleans()):
        ids.append(True)  # == 1, the BOS token
        i = len(ids) - 1
    else:
        words = case.tokenizer.get_vocab()
        plain = [i for i, token in enumerate(ids) if token in {words[w] for w in tm.PLAIN_WORDS}]
        i = draw(st.sampled_from(plain))
        ids[i] = float(ids[i])
    return stricter(PromptTypeError, f"$.prompt_token_ids[{i}]")


@mutation(kind="tokens")
def prompt_not_str_beside_tokens(draw: st.DrawFn, case: Case) -> Outcome:
    case.prompt["prompt"] = draw(st.sampled_from([5, b"what", ["what"]]))
    return stricter(PromptTypeError, "$.prompt")


@mutation()
def cache_salt_not_str(draw: st.DrawFn, case: Case) -> Outcome:
    case.prompt["cache_salt"] = draw(st.sampled_from([7, b"salt", ["salt"]]))
    return stricter(PromptTypeError, "$.cache_salt")


@mutation(min_items=1)
def media_io_value_not_mapping(draw: st.DrawFn, case: Case) -> Outcome:
    m = _modality(draw, case)
    case.prompt["media_io_kwargs"] = {m: draw(st.sampled_from([5, "x", [1]]))}
    return stricter(PromptTypeError, f"$.media_io_kwargs.{m}")


@mutation(media=False)
def bad_options_without_media(draw: st.DrawFn, case: Case) -> Outcome:
    field = draw(st.sampled_from(["multi_modal_uuids", "mm_processor_kwargs", "media_io_kwargs"]))
    case.prompt[field] = draw(st.sampled_from([["x"], "x", 5]))
    return stricter(PromptTypeError, f"$.{field}")


# vLLM refuses what we take (see DIVERGENCES).


@mutation(model="qwen2_audio", min_items=1)
def audio_waveform_a_list_with_its_rate(draw: st.DrawFn, case: Case) -> Outcome:
    i = draw(st.integers(0, case.counts["audio"] - 1))
    case.items("audio")[i] = ([float(x) for x in draw(_wave)], 16000)
    return OUT_OF_REACH


@mutation()
def unsupported_modality(draw: st.DrawFn, case: Case) -> Outcome:
    valid = {
        "image": np.zeros((28, 28, 3), np.uint8),
        "video": np.zeros((2, 28, 28, 3), np.uint8),
        "audio": np.zeros(1600, np.float32),
        "point_cloud": np.zeros((28, 28, 3), np.uint8),
    }
    others = [m for m in valid if m not in case.model.modalities]
    modality = draw(st.sampled_from(others))
    case.data[modality] = valid[modality]
    return OUT_OF_REACH


@mutation()
def placeholder_count_mismatch(draw: st.DrawFn, case: Case) -> Outcome:
    m = draw(st.sampled_from(case.model.modalities))
    if case.counts.get(m):
        case.items(m).append(draw(MEDIA[m]))
        if m in case.uuids:
            case.uuid_list(m).append(None)
    else:
        case.data[m] = [draw(MEDIA[m])]
    return OUT_OF_REACH


@mutation(min_items=1)
def cached_only_item_not_cached(draw: st.DrawFn, case: Case) -> Outcome:
    m = _modality(draw, case)
    i = draw(st.integers(0, case.counts[m] - 1))
    case.items(m)[i] = None
    case.uuid_list(m)[i] = case.fresh_uuid(draw)
    return OUT_OF_REACH


@mutation(kind="tokens")
def token_id_out_of_vocab(draw: st.DrawFn, case: Case) -> Outcome:
    ids = case.prompt["prompt_token_ids"]
    ids[draw(st.integers(0, len(ids) - 1))] = draw(st.sampled_from([len(case.tokenizer), 10**6]))
    return OUT_OF_REACH


@mutation(kind="tokens")
def token_id_negative(draw: st.DrawFn, case: Case) -> Outcome:
    # Out of every vocabulary: no model is needed to refuse it.
    ids = case.prompt["prompt_token_ids"]
    i = draw(st.integers(0, len(ids) - 1))
    ids[i] = draw(st.sampled_from([-1, -(2**31)]))
    return refused(InvalidPromptError, f"$.prompt_token_ids[{i}]")


@mutation(media=False)
def empty_prompt(draw: st.DrawFn, case: Case) -> Outcome:
    case.prompt.pop("multi_modal_data", None)
    if case.kind == "text":
        case.prompt["prompt"] = ""
    else:
        case.prompt["prompt_token_ids"] = []
        case.prompt.pop("prompt", None)
    return OUT_OF_REACH


@mutation()
def prompt_embeds_disabled(draw: st.DrawFn, case: Case) -> Outcome:
    case.prompt.pop("prompt", None)
    case.prompt.pop("prompt_token_ids", None)
    case.prompt["prompt_embeds"] = torch.zeros(3, 64)
    return OUT_OF_REACH


@mutation()
def encoder_decoder_prompt(draw: st.DrawFn, case: Case) -> Outcome:
    case.prompt = {"encoder_prompt": case.prompt, "decoder_prompt": None}
    return OUT_OF_REACH


@mutation(kind="tokens", media=False)
def token_ids_numpy(draw: st.DrawFn, case: Case) -> Outcome:
    case.prompt["prompt_token_ids"] = np.array(case.prompt["prompt_token_ids"], dtype=np.int64)
    return OUT_OF_REACH


# -- the checks --


@pytest.fixture(scope="module")
def boundary(tiny_models: dict[str, TinyModel], uncached_renderer: Any) -> dict[str, tuple[Any, Any]]:
    """Per model: a renderer without processor cache and an InputProcessor sharing it."""
    result = {}
    for name in MODELS:
        renderer = uncached_renderer(name)
        result[name] = (renderer, tm.build_input_processor(renderer))
    return result


def _vllm_accepts(renderer: Any, processor: Any, prompt: object) -> bool:
    try:
        through_boundary(renderer, processor, prompt)
    except Exception:  # noqa: BLE001 - vLLM refuses with many exception types
        return False
    return True


def _from_vllm(prompt: object) -> tuple[Any, OmniRequestsError | None]:
    try:
        return from_vllm(prompt), None
    except OmniRequestsError as error:
        return None, error


def _check(name: str, data: st.DataObject, tiny_models: dict[str, TinyModel], boundary: Any) -> None:
    needs, edit = MUTATIONS[name]
    models, needs = _models(needs)
    model_name = data.draw(st.sampled_from(models), label="model")
    renderer, processor = boundary[model_name]
    case = data.draw(cases(tiny_models[model_name], renderer.get_tokenizer(), **needs), label="valid prompt")
    expected = edit(data.draw, case)
    prompt = case.prompt

    # Ours first: from_vllm never changes its input, vLLM may.
    record, error = _from_vllm(prompt)
    if error is None:
        assert expected.we_accept, f"from_vllm took a prompt it should refuse at {expected.path}"
    else:
        assert expected.error is not None, f"from_vllm refused a prompt it should take: {error}"
        assert type(error) is expected.error, error
        assert error.path == expected.path, error
        assert str(error).startswith(f"{expected.path}: ")

    assert _vllm_accepts(renderer, processor, prompt) is expected.vllm_accepts, (
        "vLLM's behaviour changed; update the outcome (and DIVERGENCES)"
    )

    if record is None:
        return
    if expected.vllm_accepts:
        got, want = render(renderer, to_vllm(record)), render(renderer, prompt)
        if not want.get("mm_hashes") and not got.get("mm_hashes"):
            # No item either way: vLLM calls a prompt whose modalities are all None
            # "multimodal", the record (no media) a text prompt; tokens and all else agree.
            empty = ("mm_kwargs", "mm_hashes", "mm_placeholders")
            want = {**{k: v for k, v in want.items() if k not in empty}, "type": got["type"]}
        assert_same_engine_input(got, want)
    else:
        # What a record cannot know, vLLM still refuses at the boundary; a normalised
        # value is handed over in the shape vLLM takes.
        normalised = DIVERGENCES.get(name, Divergence("stricter", "")).kind == "normalised"
        assert _vllm_accepts(renderer, processor, to_vllm(record)) is normalised


EXAMPLES = {"valid": 200}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_from_vllm_agrees_with_vllms_boundary(
    name: str, tiny_models: dict[str, TinyModel], boundary: dict[str, tuple[Any, Any]]
) -> None:
    @settings(
        max_examples=EXAMPLES.get(name, 15),
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        _check(name, data, tiny_models, boundary)

    check()


def _declared_outcome(name: str, tiny_models: dict[str, TinyModel], boundary: Any) -> Outcome:
    needs, edit = MUTATIONS[name]
    models, needs = _models(needs)
    seen: list[Outcome] = []

    @settings(max_examples=1, deadline=None, database=None)
    @given(data=st.data())
    def draw_one(data: st.DataObject) -> None:
        model = tiny_models[data.draw(st.sampled_from(models))]
        case = data.draw(cases(model, boundary[model.name][0].get_tokenizer(), **needs))
        seen.append(edit(data.draw, case))

    draw_one()
    return seen[0]


def test_divergences_are_exactly_the_mutations_whose_outcomes_differ(
    tiny_models: dict[str, TinyModel], boundary: dict[str, tuple[Any, Any]]
) -> None:
    differing = {
        name
        for name in MUTATIONS
        if (outcome := _declared_outcome(name, tiny_models, boundary)).vllm_accepts != outcome.we_accept
    }
    assert differing == set(DIVERGENCES)
