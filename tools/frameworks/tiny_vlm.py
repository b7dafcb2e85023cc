"""Tiny, randomly initialised vision-language models with their processors, saved where a framework's command line loads
them as local models (nothing downloaded), and an SFT dataset with images (issue 67).

    python tools/frameworks/tiny_vlm.py OUT_DIR [FAMILY ...]

writes OUT_DIR/<family> (config, weights, tokenizer, image processor, processor, chat template) for each family
(``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl``), OUT_DIR/images/*.png (56 x 56 pictures: 4 image tokens each after the
processor's 2 x 2 merge) and OUT_DIR/vlm.jsonl: tiny_model's 8 conversations, each user turn with one image, so that the
micro-batches carry uneven counts of counted tokens (the case where a mean of micro-batch means differs from the token
mean).

The tokenizer is tiny_model's byte-level one with the families' special tokens; the image processor is the
Pillow-backed one (its ``min_pixels`` / ``max_pixels`` keep 56 x 56); the video processor is Qwen2-VL's (required by the processor; no video is used).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import tiny_model  # noqa: E402

VISION = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# Qwen2-VL's chat template, as its processor ships it: images between the vision markers in the user's turn
TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
            "{{ message['content'] }}{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' "
            "%}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'text' %}{{ content['text'] }}"
            "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>"
            "assistant\n{% endif %}")
SIDE = 56  # pixels: 4 x 4 patches of 14, merged 2 x 2 into 4 image tokens


# Qwen's own ids of the vision tokens: ms-swift's Qwen2-VL template expands an image's one placeholder into its grid's
# tokens only where the placeholder has id 151655 (its class attribute `image_token_id`), and then scatters the vision
# features over whatever placeholders there are without counting them. A vocabulary that gives the placeholder
# another id trains each sample on the batch's first features (issue 67, item 4: the 1-2e-2 "difference" of ms-swift's
# Qwen2-VL rows): the swift suite's models put the tokens here (the ids between stay unused).
QWEN_IDS = {"<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|image_pad|>": 151655, "<|video_pad|>": 151656}


def tokenizer(qwen_ids: bool = False):
    if not qwen_ids:
        tok = tiny_model.tokenizer()
        tok.add_special_tokens({"additional_special_tokens": VISION})
        return tok
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(tiny_model.SPECIALS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    vocab.update(QWEN_IDS)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(tiny_model.SPECIALS + VISION)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="<|im_end|>",
                                  unk_token=None, additional_special_tokens=VISION)
    tok.chat_template = tiny_model.CHATML
    return tok


def _vocab_size(tok) -> int:
    return max(tok.get_vocab().values()) + 1  # a vocabulary with unused ids counts them


def _text(family: str, vocab: int, tok) -> dict:
    common = {"vocab_size": vocab, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
              "pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
              "attention_dropout": 0.0, "tie_word_embeddings": False}
    # multimodal rotary sections (temporal, height, width) summing to half a head (32 / 4 / 2 = 4)
    if family == "qwen3_vl":
        return {**common, "head_dim": 8, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                              "mrope_section": [2, 1, 1], "mrope_interleaved": True}}
    return {**common, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}}


def _vision(family: str) -> dict:
    if family == "qwen2_vl":
        return {"depth": 1, "embed_dim": 32, "hidden_size": 32, "num_heads": 2, "mlp_ratio": 2, "patch_size": 14,
                "spatial_merge_size": 2, "temporal_patch_size": 2}
    if family == "qwen2_5_vl":
        return {"depth": 1, "hidden_size": 32, "out_hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
                "fullatt_block_indexes": [0]}
    return {"depth": 1, "hidden_size": 32, "out_hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
            "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 16,
            "deepstack_visual_indexes": []}


def build_model(out: Path, family: str, qwen_ids: bool = False) -> Path:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = tokenizer(qwen_ids)
    ids = {name: tok.convert_tokens_to_ids(name) for name in VISION}
    config = AutoConfig.for_model(
        family, text_config=_text(family, _vocab_size(tok), tok), vision_config=_vision(family),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config)
    where = out / family
    model.save_pretrained(where)
    images = Qwen2VLImageProcessorPil(min_pixels=SIDE * SIDE, max_pixels=SIDE * SIDE, patch_size=14,
                                      merge_size=2, temporal_patch_size=2)
    processor_type = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor",
                      "qwen3_vl": "Qwen3VLProcessor"}[family]
    videos = transformers.Qwen2VLVideoProcessor(min_pixels=SIDE * SIDE, max_pixels=SIDE * SIDE, patch_size=14,
                                                merge_size=2, temporal_patch_size=2)  # required; no video is used
    processor = getattr(transformers, processor_type)(image_processor=images, tokenizer=tok, video_processor=videos,
                                                      chat_template=TEMPLATE)
    processor.save_pretrained(where)
    return where


def build_data(out: Path) -> None:
    """OUT/images/<i>.png and OUT/vlm.jsonl (sharegpt messages, ``<image>`` in each user turn, one image each)."""
    import numpy
    from PIL import Image

    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = numpy.random.default_rng(0)
    with open(out / "vlm.jsonl", "w") as f:
        for i, (prompt, answer) in enumerate(zip(tiny_model.PROMPTS, tiny_model.CHOSEN)):
            path = out / "images" / f"{i}.png"
            Image.fromarray(rng.integers(0, 256, (SIDE, SIDE, 3), dtype=numpy.uint8)).save(path)
            f.write(json.dumps({"messages": [{"role": "user", "content": f"<image>{prompt}"},
                                             {"role": "assistant", "content": answer}],
                                "images": [str(path)]}) + "\n")


def build(out: Path, families=FAMILIES, qwen_ids: bool = False) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for family in families:
        build_model(out, family, qwen_ids)
    build_data(out)


if __name__ == "__main__":
    build(Path(sys.argv[1]), tuple(sys.argv[2:]) or FAMILIES)
