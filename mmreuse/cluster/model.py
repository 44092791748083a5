"""The random-weight Qwen2-VL model folder the CPU cluster serves (`--load-format dummy`).

Written offline as plain JSON/text, with no torch, no tokenizers library and no model hub:
config.json (the sizes of a `ModelProfile`: the tiny 2-layer, 128-wide Qwen2-VL with a 1-block
ViT, or the serving-shape one), a byte-level BPE tokenizer.json (256 byte tokens, id = byte
value, no merges, plus Qwen2-VL's special tokens), tokenizer_config, the Qwen2-VL chat template,
and image/video preprocessor configs (the profile's pixel limits).
vLLM's dummy loader initialises the weights, so no weight file exists. Qwen2-VL is what vLLM's
own EPD examples use; its processor needs torchvision, which `install.py` makes importable.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from .profile import ARCHITECTURES, TINY, ModelProfile

__all__ = [
    "IMAGE_PAD_ID",
    "SPECIAL_TOKENS",
    "VOCAB_SIZE",
    "build_model",
    "check_model",
    "model_files",
]

SPECIAL_TOKENS: dict[str, int] = {
    name: 256 + i
    for i, name in enumerate(
        (
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<|object_ref_start|>",
            "<|object_ref_end|>",
            "<|box_start|>",
            "<|box_end|>",
            "<|quad_start|>",
            "<|quad_end|>",
            "<|vision_start|>",
            "<|vision_end|>",
            "<|vision_pad|>",
            "<|image_pad|>",
            "<|video_pad|>",
        )
    )
}
IMAGE_PAD_ID = SPECIAL_TOKENS["<|image_pad|>"]
VOCAB_SIZE = 512  # the embedding's rows; the tokenizer uses 270 of them
_ADDITIONAL_SPECIALS: tuple[str, ...] = (
    "im_start",
    "im_end",
    "vision_start",
    "vision_end",
    "vision_pad",
)
_ADDITIONAL_SPECIALS += ("image_pad", "video_pad")

CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character map (what the ByteLevel pre-tokenizer emits),
    indexed by byte value."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table: dict[int, str] = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def _byte_level(**flags: bool) -> dict[str, object]:
    return {"type": "ByteLevel", **flags}


def _tokenizer_json() -> dict[str, object]:
    vocab: dict[str, int] = {ch: b for b, ch in enumerate(_byte_alphabet())}
    vocab.update(SPECIAL_TOKENS)
    added = [
        {
            "id": i,
            "content": name,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for name, i in SPECIAL_TOKENS.items()
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": _byte_level(add_prefix_space=False, trim_offsets=True, use_regex=True),
        "post_processor": _byte_level(add_prefix_space=True, trim_offsets=False, use_regex=True),
        "decoder": _byte_level(add_prefix_space=True, trim_offsets=True, use_regex=True),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }


def _tokenizer_config(profile: ModelProfile) -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {
            str(i): {
                "content": name,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for name, i in SPECIAL_TOKENS.items()
        },
        "additional_special_tokens": [f"<|{n}|>" for n in _ADDITIONAL_SPECIALS],
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": profile.max_model_len,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }


def _config(profile: ModelProfile) -> dict[str, object]:
    ids = SPECIAL_TOKENS
    mrope = profile.mrope_section
    return {
        "architectures": [ARCHITECTURES[profile.architecture]],
        "model_type": profile.architecture,
        "torch_dtype": profile.dtype,
        "vocab_size": VOCAB_SIZE,
        "hidden_size": profile.hidden,
        "intermediate_size": profile.intermediate,
        "num_hidden_layers": profile.layers,
        "num_attention_heads": profile.heads,
        "num_key_value_heads": profile.kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": profile.max_model_len,
        "max_window_layers": profile.layers,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": list(mrope)},
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "use_cache": True,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_config": _vision_config(profile),
    }


def _vision_config(profile: ModelProfile) -> dict[str, object]:
    """The ViT's config, in its architecture's field names."""
    shared = {
        "depth": profile.vit_depth,
        "num_heads": profile.vit_heads,
        "in_channels": 3,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    if profile.architecture == "qwen2_vl":
        return {
            "model_type": "qwen2_vl_vision",
            **shared,
            "embed_dim": profile.vit_width,
            "hidden_size": profile.hidden,  # the merger's output width = the LM's
            "hidden_act": "quick_gelu",
            "mlp_ratio": profile.vit_mlp_ratio,
        }
    return {  # Qwen2.5-VL: windows of 112 pixels, full attention in `vit_full_blocks` only
        "model_type": "qwen2_5_vl_vision",
        **shared,
        "hidden_size": profile.vit_width,
        "out_hidden_size": profile.hidden,  # the merger's output width = the LM's
        "intermediate_size": profile.vit_mlp_ratio * profile.vit_width,
        "hidden_act": "silu",
        "window_size": 112,
        "fullatt_block_indexes": list(profile.vit_full_blocks),
        "tokens_per_second": 2,
    }


_PROCESSORS = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}


def _image_processor(profile: ModelProfile) -> dict[str, object]:
    return {
        "image_processor_type": "Qwen2VLImageProcessor",  # Qwen2.5-VL's too
        "processor_class": _PROCESSORS[profile.architecture],
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "rescale_factor": 1 / 255,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "min_pixels": profile.min_pixels,
        "max_pixels": profile.max_pixels,
        "size": {"shortest_edge": profile.min_pixels, "longest_edge": profile.max_pixels},
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }


def model_files(profile: ModelProfile = TINY) -> dict[str, str]:
    """The folder's files for `profile`: name -> text."""
    config = _config(profile)
    image = _image_processor(profile)
    video = {k: v for k, v in image.items() if k != "image_processor_type"}
    video["video_processor_type"] = "Qwen2VLVideoProcessor"
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    docs: dict[str, object] = {
        "config.json": config,
        "generation_config.json": {**generation, "do_sample": False},
        "tokenizer.json": _tokenizer_json(),
        "tokenizer_config.json": _tokenizer_config(profile),
        "special_tokens_map.json": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        "chat_template.json": {"chat_template": CHAT_TEMPLATE},
        "preprocessor_config.json": image,
        "video_preprocessor_config.json": video,
    }
    files = {
        name: json.dumps(doc, indent=2, ensure_ascii=False) + "\n" for name, doc in docs.items()
    }
    files["chat_template.jinja"] = CHAT_TEMPLATE
    return files


def build_model(out_dir: Path, profile: ModelProfile = TINY) -> Path:
    """Write the model folder of `profile` (overwriting its files); returns it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in model_files(profile).items():
        (out_dir / name).write_text(text, encoding="utf-8")
    return out_dir


_CHECK = r"""
import json, sys, transformers
from PIL import Image
d = sys.argv[1]
p = transformers.AutoProcessor.from_pretrained(d)
assert type(p).__name__ == sys.argv[3], (type(p).__name__, sys.argv[3])
msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
text = p.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
out = p(text=[text], images=[Image.new("RGB", (64, 64), (200, 30, 30))], return_tensors="np")
ids = out["input_ids"][0].tolist()
t, h, w = out["image_grid_thw"][0].tolist()
n_pad = ids.count(int(sys.argv[2]))
assert n_pad == t * h * w // 4, (n_pad, t, h, w)
assert p.tokenizer.decode(p.tokenizer("héllo <|im_end|>")["input_ids"]) == "héllo <|im_end|>"
cfg = transformers.AutoConfig.from_pretrained(d)
print(json.dumps({"processor": type(p).__name__, "tokenizer": type(p.tokenizer).__name__,
                  "config": type(cfg).__name__, "prompt_tokens": len(ids), "image_tokens": n_pad,
                  "grid": [t, h, w]}))
"""


def check_model(model_dir: Path, python: Path, timeout: float = 300.0) -> dict[str, object]:
    """Load the folder with transformers' AutoProcessor in the side venv (`python`): the
    processor class (its preprocessor_config's), the chat template, image expansion and a tokenizer round trip.
    Returns what it saw; raises RuntimeError with the child's output when a check fails."""
    preprocessor = json.loads((Path(model_dir) / "preprocessor_config.json").read_text())
    out = subprocess.run(
        [
            str(python),
            "-c",
            _CHECK,
            str(model_dir),
            str(IMAGE_PAD_ID),
            preprocessor["processor_class"],
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    if out.returncode != 0:
        raise RuntimeError(f"model check failed for {model_dir}:\n{out.stderr[-3000:]}")
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result
