"""A tiny Qwen2-VL with random weights that vLLM's CPU engine can run (about 1.5 MB).

Built here with transformers' own classes and saved with ``save_pretrained``, so the
folder has the layout the installed transformers reads. Nothing is downloaded. The
sizes are the smallest vLLM's CPU backends accept: attention heads of 32 dimensions,
an M-RoPE split that sums to half of that.
"""

from __future__ import annotations

from pathlib import Path

SPECIAL = (
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
WORDS = ("user", "assistant", "describe", "this", "video", "image", "what", "happens", "?", ".")
_BASE = ("<unk>", "<s>", "</s>", "<pad>")


def prompt(videos: int = 1, images: int = 0) -> str:
    """A prompt with one placeholder per item, in the model's own tokens."""
    image = "<|vision_start|><|image_pad|><|vision_end|>" * images
    video = "<|vision_start|><|video_pad|><|vision_end|>" * videos
    return f"<|im_start|>user {image}{video}describe this<|im_end|>"


def make_tiny_qwen2_vl(folder: Path, *, seed: int = 0) -> Path:
    """Write the model folder (config, random weights, tokenizer, processor) and return it."""
    import torch
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    folder = Path(folder).absolute()
    folder.mkdir(parents=True, exist_ok=True)

    # A word-level vocabulary padded with numbered words, so random logits pick varied tokens.
    words = [*_BASE, *SPECIAL, *WORDS, *(f"w{i}" for i in range(200))]
    vocab = {word: i for i, word in enumerate(words)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (*_BASE, *SPECIAL)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=4096,
    )

    pixels = {"min_pixels": 28 * 28, "max_pixels": 112 * 112}
    size = {"shortest_edge": pixels["min_pixels"], "longest_edge": pixels["max_pixels"]}
    vision = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=size, **vision),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(size=size, do_sample_frames=False, **vision),
    )
    processor.save_pretrained(folder)

    config = Qwen2VLConfig(
        text_config={
            "vocab_size": len(vocab),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
            "rope_theta": 10000.0,
            "bos_token_id": vocab["<s>"],
            "eos_token_id": vocab["</s>"],
            "pad_token_id": vocab["<pad>"],
            "tie_word_embeddings": False,
        },
        vision_config={
            "depth": 2,
            "embed_dim": 64,
            "hidden_size": 64,
            "mlp_ratio": 2,
            "num_heads": 2,
            "in_channels": 3,
            **{"patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
        },
        image_token_id=vocab["<|image_pad|>"],
        video_token_id=vocab["<|video_pad|>"],
        vision_start_token_id=vocab["<|vision_start|>"],
        vision_end_token_id=vocab["<|vision_end|>"],
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config)
    with torch.no_grad():  # random weights of a scale that keeps logits apart
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    return folder
