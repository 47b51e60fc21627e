"""vllm-omni's prompt fields: parity with the real TypedDicts, and payloads that stay put.

The parity tests read ``vllm_omni.inputs.data`` of the installed vllm-omni (0.30.0) in
a subprocess, because importing vllm_omni patches vLLM process-wide.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

from omni_requests import (
    EmbedsPrompt,
    InvalidPromptError,
    MediaHasher,
    PromptTypeError,
    TextPrompt,
    TokensPrompt,
)
from omni_requests_omni import RoundRobin, Stage0Pool, scope_stage0
from omni_requests_vllm import from_vllm, to_vllm

from ._helpers import containers, deep_equal, image_array

torch = pytest.importorskip("torch")

PROBE = Path(__file__).with_name("_omni_typeddicts.py")
KINDS = {"OmniTextPrompt": TextPrompt, "OmniTokensPrompt": TokensPrompt, "OmniEmbedsPrompt": EmbedsPrompt}


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None  # finds, never imports


@pytest.fixture(scope="module")
def omni_typeddicts() -> dict[str, Any]:
    if not (_installed("vllm") and _installed("vllm_omni")):
        pytest.skip("needs vllm and vllm-omni 0.30.0 (pip install --no-deps vllm-omni==0.30.0 ...)")
    done = subprocess.run(
        [sys.executable, str(PROBE)], capture_output=True, text=True, timeout=300, check=False
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("JSON:")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    found: dict[str, Any] = json.loads(lines[-1][len("JSON:") :])
    assert "vllm_omni" not in sys.modules  # the probe ran elsewhere
    return found


def _record_fields(kind: type[Any]) -> set[str]:
    return {field.name for field in attrs.fields(kind)} - {"scope"}


def _every_field(kind: type[Any]) -> dict[str, Any]:
    """A vllm-omni dict of ``kind`` with every field the record knows set."""
    values: dict[str, Any] = {
        "prompt": "<image> a cat",
        "prompt_token_ids": [1, 2, 3],
        "token_type_ids": [0, 0, 1],
        "prompt_token_offsets": [0, 1],
        "prompt_is_token_ids": [True, False],
        "prompt_embeds": torch.zeros(3, 4),
        "negative_prompt": "blurry",
        "negative_prompt_embeds": torch.ones(2, 4),
        "modalities": ["image"],
        "multi_modal_data": {"image": [image_array(1)]},
        "multi_modal_uuids": {"image": ["cat-1"]},
        "mm_processor_kwargs": {"fps": 2},
        "media_io_kwargs": {"video": {"num_frames": 4}},
        "cache_salt": "tenant-a",
        "additional_information": {"speaker": ["vivian"], "meta": {"lang": "en"}},
        "model_intermediate_buffer": {"codes": [1, 2]},
    }
    if kind is not TextPrompt:
        values["negative_prompt_embeds"] = [torch.ones(2, 4)]
    return {name: values[name] for name in _record_fields(kind)}


@pytest.mark.vllm
@pytest.mark.parametrize("name", sorted(KINDS))
def test_records_have_exactly_the_fields_of_vllm_omni_prompts(
    omni_typeddicts: dict[str, Any], name: str
) -> None:
    real = set(omni_typeddicts[name]["fields"])
    ours = _record_fields(KINDS[name])
    assert ours == real, f"missing: {sorted(real - ours)}, extra: {sorted(ours - real)}"


@pytest.mark.vllm
@pytest.mark.parametrize("name", sorted(KINDS))
def test_to_vllm_emits_the_omni_keys_and_from_vllm_takes_them_back(
    omni_typeddicts: dict[str, Any], name: str
) -> None:
    kind = KINDS[name]
    given = _every_field(kind)
    record = from_vllm(given)
    assert type(record) is kind
    out = to_vllm(record)
    assert set(out) == set(omni_typeddicts[name]["fields"])
    assert from_vllm(out) == record


def test_a_text_or_tokens_prompt_carrying_embeddings_of_no_embeds_shape_reads_back_as_itself() -> None:
    # vllm-omni's diffusion stages take a text prompt's embeddings batched ((2, seq, hidden)
    # for two images); from_vllm read every dict carrying prompt_embeds as an embeds prompt
    # and refused that shape, so such a record's own dict did not read back (found by the
    # long constructor fuzz).
    for embeds in (torch.zeros(2, 3, 4), torch.zeros(4), torch.tensor(0.0), torch.zeros(1, 2, 3, 4)):
        for record in (
            TextPrompt(prompt="a cat", prompt_embeds=embeds),
            TokensPrompt(prompt_token_ids=[1, 2], prompt_embeds=embeds),
        ):
            sent = to_vllm(record)
            assert from_vllm(sent) == record
        with pytest.raises(InvalidPromptError, match=r"must be of shape \(seq_len, hidden_size\)") as caught:
            from_vllm({"prompt_embeds": embeds})  # nothing else tells the kind: an embeds prompt
        assert caught.value.path == "$.prompt_embeds"
    # Embeddings of an embeds prompt's shape still make the dict one, as vLLM reads it.
    for embeds in (torch.zeros(3, 4), torch.zeros(1, 3, 4)):
        assert type(from_vllm({"prompt": "a cat", "prompt_embeds": embeds})) is EmbedsPrompt
        assert type(from_vllm({"prompt_token_ids": [1], "prompt_embeds": embeds})) is EmbedsPrompt


@pytest.mark.vllm
def test_required_keys_match_but_for_embeds(omni_typeddicts: dict[str, Any]) -> None:
    def required(kind: type[Any]) -> set[str]:
        return {f.name for f in attrs.fields(kind) if f.default is attrs.NOTHING}

    assert required(TextPrompt) == set(omni_typeddicts["OmniTextPrompt"]["required"]) == {"prompt"}
    assert required(TokensPrompt) == set(omni_typeddicts["OmniTokensPrompt"]["required"])
    # vllm-omni relaxes prompt_embeds to NotRequired; a dict without it is no embeds prompt
    # for vLLM (it is read as text or tokens), so the record keeps vLLM's requirement.
    assert omni_typeddicts["OmniEmbedsPrompt"]["required"] == []
    assert required(EmbedsPrompt) == {"prompt_embeds"}


@pytest.mark.vllm
@pytest.mark.parametrize("name", sorted(KINDS))
def test_negative_prompt_embeds_takes_a_list_exactly_where_vllm_omni_does(
    omni_typeddicts: dict[str, Any], name: str
) -> None:
    annotation = omni_typeddicts[name]["fields"]["negative_prompt_embeds"]
    kind = KINDS[name]
    given = {k: v for k, v in _every_field(kind).items() if k != "negative_prompt_embeds"}
    if "list[" in annotation:
        assert (
            len(from_vllm({**given, "negative_prompt_embeds": [torch.ones(1)]}).negative_prompt_embeds) == 1
        )
    else:
        with pytest.raises(PromptTypeError, match=r"\$\.negative_prompt_embeds"):
            from_vllm({**given, "negative_prompt_embeds": [torch.ones(1)]})


@pytest.mark.vllm
def test_modalities_is_a_text_prompt_field_of_str_lists(omni_typeddicts: dict[str, Any]) -> None:
    assert "list[str]" in omni_typeddicts["OmniTextPrompt"]["fields"]["modalities"]
    assert TextPrompt(prompt="x", modalities=("img2img",)).modalities == ["img2img"]
    with pytest.raises(PromptTypeError, match=r"\$\.modalities\[1\]: must be a str, got int"):
        TextPrompt(prompt="x", modalities=["image", 3])
    with pytest.raises(PromptTypeError, match=r"\$\.modalities: must be a list of str, got str"):
        TextPrompt(prompt="x", modalities="image")
    with pytest.raises(InvalidPromptError, match=r"\$\.modalities: unknown field for a TokensPrompt"):
        from_vllm({"prompt_token_ids": [1], "modalities": ["image"]})


# -- stage payloads are persistent --------------------------------------------------------


def _inject_global_id(prompt: dict[str, Any], request_id: str) -> None:
    """What a later stage does to the dict it is handed (vllm-omni writes the request id)."""
    info = prompt.setdefault("additional_information", {})
    info["global_request_id"] = [request_id]
    info["meta"].pop("lang", None)
    info["speaker"].append("someone else")
    prompt.setdefault("model_intermediate_buffer", {})["codes"].append(99)


TEMPLATE: dict[str, Any] = {
    "prompt": "<image> say it",
    "multi_modal_data": {"image": image_array(7)},
    "additional_information": {"speaker": ["vivian"], "meta": {"lang": "en"}},
    "model_intermediate_buffer": {"codes": [1, 2]},
}


def test_a_later_stage_writing_into_the_payload_reaches_neither_the_record_nor_other_requests() -> None:
    record = from_vllm(TEMPLATE)
    before = copy.deepcopy(record)
    first = to_vllm(record)
    _inject_global_id(first, "req-1")
    second = to_vllm(record)
    assert record == before
    assert second["additional_information"] == {"speaker": ["vivian"], "meta": {"lang": "en"}}
    assert second["model_intermediate_buffer"] == {"codes": [1, 2]}
    assert first["additional_information"]["global_request_id"] == ["req-1"]


def test_the_callers_dict_is_copied_in_and_never_written_through_scope_stage0() -> None:
    template = copy.deepcopy(TEMPLATE)
    pristine = copy.deepcopy(template)
    record = from_vllm(template)
    template["additional_information"]["meta"]["lang"] = "fr"  # the caller edits after building
    assert record.additional_information["meta"]["lang"] == "en"
    template["additional_information"]["meta"]["lang"] = "en"

    pool = Stage0Pool(replicas=2, select=RoundRobin())
    hasher = MediaHasher("/models/omni")
    outs = []
    for request_id in ("req-1", "req-2"):
        replica, out = scope_stage0(template, pool=pool, hasher=hasher, request_id=request_id)
        assert replica is not None
        assert not set(containers(out)) & set(containers(template))
        _inject_global_id(out, request_id)
        outs.append(out)
    assert deep_equal(template, pristine)
    assert outs[0]["additional_information"]["global_request_id"] == ["req-1"]
    assert outs[1]["additional_information"]["global_request_id"] == ["req-2"]
    assert outs[1]["additional_information"]["speaker"] == ["vivian", "someone else"]  # one append, its own


def test_payloads_pickle_and_compare_by_content() -> None:
    record = TextPrompt(
        prompt="x",
        modalities=["text"],
        model_intermediate_buffer={"hidden": np.arange(4.0), "ids": [1]},
    )
    again = pickle.loads(pickle.dumps(record))
    assert again == record
    assert again.model_intermediate_buffer is not None
    assert not again.model_intermediate_buffer["hidden"].flags.writeable
    assert record != attrs.evolve(record, model_intermediate_buffer={"hidden": np.arange(5.0), "ids": [1]})
