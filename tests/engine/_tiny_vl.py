"""A tiny Qwen2-VL with random weights that vLLM's CPU build can load and run.

Written offline in a few seconds: ``config.json`` with tiny sizes, a byte-level BPE
tokenizer (the 256 byte symbols, no merges, plus Qwen2-VL's special tokens), the image
and video processor settings, and ``model.safetensors`` from transformers' own
``Qwen2VLForConditionalGeneration`` initialised under a fixed seed, so every run gets
the same weights and the same greedy tokens. Sizes follow what vLLM's CPU backend takes:
head_dim 32, ``mrope_section`` summing to head_dim / 2.

A 56x56 image is 4 placeholder tokens, a (4, 56, 56, 3) video 8.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["SPECIAL_TOKENS", "make_tiny_qwen2_vl", "prompt_text"]

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

_SEED = 20261203
_PATCH, _MERGE, _TEMPORAL = 14, 2, 2
_MIN_PIXELS, _MAX_PIXELS = 56 * 56, 56 * 56


def prompt_text(*, image: int = 0, video: int = 0, text: str = "Describe this.") -> str:
    """A user turn with one placeholder per item, the way Qwen2-VL's chat template writes it."""
    images = "<|vision_start|><|image_pad|><|vision_end|>" * image
    videos = "<|vision_start|><|video_pad|><|vision_end|>" * video
    return f"<|im_start|>user\n{images}{videos}{text}<|im_end|>\n<|im_start|>assistant\n"


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _write_tokenizer(folder: Path) -> dict[str, int]:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.save(str(folder / "tokenizer.json"))
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    _write_json(
        folder / "tokenizer_config.json",
        {
            "tokenizer_class": "Qwen2TokenizerFast",
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "bos_token": None,
            "model_max_length": 512,
            "clean_up_tokenization_spaces": False,
        },
    )
    return {**ids, "vocab_size": tokenizer.get_vocab_size()}


def _config(ids: dict[str, int]) -> dict[str, Any]:
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "torch_dtype": "float32",
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "qwen2_vl_text",
            "vocab_size": ids["vocab_size"],
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "max_position_embeddings": 512,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        },
        "vision_config": {
            "model_type": "qwen2_vl",
            "depth": 2,
            "embed_dim": 64,
            "hidden_size": 64,
            "mlp_ratio": 2,
            "num_heads": 2,
            "in_channels": 3,
            "patch_size": _PATCH,
            "spatial_merge_size": _MERGE,
            "temporal_patch_size": _TEMPORAL,
        },
    }


def _processor_config() -> dict[str, Any]:
    common: dict[str, Any] = {
        "do_resize": True,
        "size": {"shortest_edge": _MIN_PIXELS, "longest_edge": _MAX_PIXELS},
        "min_pixels": _MIN_PIXELS,
        "max_pixels": _MAX_PIXELS,
        "patch_size": _PATCH,
        "merge_size": _MERGE,
        "temporal_patch_size": _TEMPORAL,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_convert_rgb": True,
        "resample": 3,
    }
    # transformers 5 keeps both processors' settings in one file.
    return {
        "processor_class": "Qwen2VLProcessor",
        "image_processor": {"image_processor_type": "Qwen2VLImageProcessor", **common},
        "video_processor": {
            "video_processor_type": "Qwen2VLVideoProcessor",
            **common,
            "do_sample_frames": False,
            "cap_pixels_per_frame": False,
        },
    }


def make_tiny_qwen2_vl(folder: Path) -> Path:
    """Write the model into ``folder`` (created) and return its absolute path."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    folder = Path(folder).absolute()
    folder.mkdir(parents=True, exist_ok=True)
    ids = _write_tokenizer(folder)
    config = _config(ids)
    _write_json(folder / "config.json", config)
    _write_json(folder / "processor_config.json", _processor_config())
    _write_json(folder / "generation_config.json", {"eos_token_id": ids["<|im_end|>"], "do_sample": False})
    torch.manual_seed(_SEED)
    model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(**config))
    # Default init gives near-uniform logits; larger weights make outputs depend
    # visibly on the media, so two videos give two different greedy continuations.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1 and "embed_tokens" not in name:
                param.normal_(0.0, 0.2)
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
