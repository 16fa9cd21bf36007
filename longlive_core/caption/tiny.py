"""The demo's caption model: a tiny, randomly initialised Qwen2.5-VL of the production class.

Its tokenizer is built here with ``tokenizers`` (a word-level vocabulary of the template's words and
some describing words, plus Qwen2.5-VL's special tokens), its chat template is a file in the repo,
and the whole folder is saved with ``save_pretrained``, so the stage loads it through the very
``from_pretrained(local_files_only=True)`` path of a downloaded Qwen2.5-VL-7B-Instruct. What it
writes is meaningless text; the stage's mechanics (frames, batching, context, truncation, the cache)
are what it exercises.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

CHAT_TEMPLATE = Path(__file__).resolve().parents[2] / "configs/caption/tiny_chat_template.jinja"
# Qwen2.5-VL's special tokens, in its order (ids differ: this vocabulary is small)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
           "<|image_pad|>", "<|video_pad|>"]
WORDS = [
    "a", "an", "the", "this", "that", "his", "her", "its", "their", "one", "two", "man", "woman", "child", "dog", "cat",
    "car", "bird", "tree", "street", "road", "city", "forest", "sea", "beach", "sky", "room", "house", "kite", "ball",
    "square", "circle", "shape", "red", "blue", "green", "yellow", "white", "black", "grey", "small", "large", "young",
    "old", "bright", "dark", "walks", "runs", "moves", "turns", "flies", "rolls", "stands", "sits", "looks", "holds",
    "rises", "falls", "camera", "close-up", "medium", "wide", "shot", "static", "pan", "tilt", "tracking", "handheld",
    "zoom", "slowly", "quickly", "light", "lighting", "soft", "hard", "warm", "cool", "daylight", "night", "sunset",
    "style", "realistic", "cinematic", "animated", "flat", "in", "on", "at", "with", "along", "across", "into", "from",
    "behind", "near", "and", "while", "then", "is", "are", ".", ",", ";", "!", "?"
]


# the tiny model's dimensions (its vocabulary is the tokenizer's)
TINY_TEXT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1, "max_position_embeddings": 8192,
             "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}
TINY_VISION = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 32,
               "fullatt_block_indexes": [1], "window_size": 56}


def build_tokenizer(extra_text: str = ""):
    """A word-level fast tokenizer over WORDS and the words of ``extra_text``, with the special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted(set(WORDS) | {w.lower() for w in re.findall(r"[A-Za-z][A-Za-z'-]*|[.,;:!?()\[\]\"]",
                                                                 extra_text)})
    vocab = {t: i for i, t in enumerate([*SPECIAL, "[UNK]", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.decoder = decoders.WordPiece(prefix="##")  # words joined by spaces, punctuation attached
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="[UNK]", padding_side="left")


def special_token_ids(tokenizer) -> tuple[dict, dict]:
    """(end, pad and bos ids; the four vision token ids) of ``tokenizer``, as Qwen2_5_VLConfig takes them."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL}
    special = {"bos_token_id": None, "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"]}
    vision = {"image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
              "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"]}
    return special, vision


def make_processor(tokenizer):
    """Qwen2.5-VL's processor (its image and video processors at their defaults) around ``tokenizer``, with
    the repo's chat template."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    return Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(), tokenizer=tokenizer,
                               video_processor=Qwen2VLVideoProcessor(),
                               chat_template=CHAT_TEMPLATE.read_text(encoding="utf-8"))


def set_end_tokens(model, special: dict) -> None:
    """Greedy generation stops at the end token and pads with the pad token, as Qwen2.5-VL-7B-Instruct's does."""
    model.generation_config.eos_token_id = special["eos_token_id"]
    model.generation_config.pad_token_id = special["pad_token_id"]
    model.generation_config.bos_token_id = None


def make_tiny_vlm(folder: str | Path, seed: int = 0, prompt_text: str = "") -> Path:
    """Writes the tiny model, its tokenizer, processor configs and chat template to ``folder``."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    folder = Path(folder)
    tokenizer = build_tokenizer(prompt_text)
    special, vision = special_token_ids(tokenizer)
    config = Qwen2_5_VLConfig(text_config={"vocab_size": len(tokenizer), **TINY_TEXT, **special},
                              vision_config=TINY_VISION, **vision, **special)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config)
    set_end_tokens(model, special)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    make_processor(tokenizer).save_pretrained(folder)
    return folder
