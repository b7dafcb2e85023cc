"""Tiny randomly initialised models and a deterministic token dataset (nothing is downloaded).

The model kinds cover the Trainer's normalisation paths:
- ``causal-lm``: a transformers LlamaForCausalLM, whose forward takes loss kwargs (num_items_in_batch);
- ``custom``: a module whose forward has no ``**kwargs``, returning the mean loss of its micro-batch;
- ``seq-cls-llama`` / ``seq-cls-bert``: LlamaForSequenceClassification and BertForSequenceClassification,
  whose forwards take ``**kwargs`` (on the releases that have them) but whose loss is the mean over the
  micro-batch's samples: the Trainer's guess from the signature is wrong for them;
- ``peft-seq-cls-llama``: the Llama classifier wrapped by PEFT (LoRA), where peft is installed;
- ``moe``: a transformers MixtralForCausalLM with ``output_router_logits`` and ``router_aux_loss_coef`` 0.5: its
  loss is the normalised cross-entropy plus the coefficient times the micro-batch's router load-balancing loss;
- ``nokw-llama``: the causal LM with the class attribute ``accepts_loss_kwargs = False`` (what 27 generation heads
  of transformers 5.24 say): the Trainer neither counts nor passes the count, though the forward would divide by it;
- ``own-mean-llama``: the same flag, and a forward that takes the count and does not pass it on (Qwen3-VL's and GLM-4V's
  pattern on transformers 4.57 - 5.6: its loss function is called without it);
- ``inline-mean-llama``: the same flag, and a forward computing its own token mean inline (Gemma 3's pattern: no loss
  function a count could reach; zerofix proves it from the logits it returns and weighs it, ``zerofix.own_mean``);
- ``fused-mean-llama``: the inline mean of a head that returns no logits when it is given labels (a fused head's
  pattern): nothing zerofix could prove the mean from, so it stays a micro-batch mean;
- ``vlm`` / ``vlm-image``: a tiny Qwen2_5_VLForConditionalGeneration (the flag False from transformers), on text-only
  samples, or on samples carrying one 2x2-patch image whose tokens are labelled -100;
- ``qwen3vl-image`` / ``glm4v-image`` / ``qwen35-image`` / ``gemma3-image``: tiny Qwen3-VL, GLM-4V, Qwen3.5 (5.x)
  and Gemma 3 ForConditionalGeneration heads on the same image samples (Gemma 3: one 4x4-pixel image of four 2x2
  patches, its tokens typed 1), the heads that compute their own mean on transformers 4.57 - 5.6 (issue 59: the count
  handed on to the loss function the first three call, Gemma 3's inline mean proven and weighed).
A sequence-level kind's samples carry one class label each (``TASK``).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 64
SEQ = 12
IGNORE = -100
NUM_LABELS = 3
MODEL_KINDS = ("causal-lm", "custom", "seq-cls-llama", "seq-cls-bert", "peft-seq-cls-llama", "moe", "nokw-llama",
               "own-mean-llama", "inline-mean-llama", "fused-mean-llama", "vlm", "vlm-image", "qwen3vl-image",
               "glm4v-image", "qwen35-image", "gemma3-image", "vipllava-image")
# the heads whose forward keeps the count from its loss on some release: their own mean, or a loss function called
# without it (VipLlava on 4.57 - 5.x, whose class does not say so: issue 69)
OWN_MEAN_IMAGE_KINDS = ("qwen3vl-image", "glm4v-image", "qwen35-image", "gemma3-image", "vipllava-image")
VLM_KINDS = ("vlm", "vlm-image")  # the tiny Qwen2.5-VL, on text only and with images
# The tiny VLM's image: tokens 1..6 of a sample are <vision_start>, four image tokens (one per 2x2 patch) and
# <vision_end>; its pixels are 4 patches of 3 x 2 x 2 values.
IMAGE_TOKEN, VISION_START, VISION_END, VIDEO_TOKEN = 60, 62, 63, 61
IMAGE_PATCHES, PATCH_VALUES = 4, 12
MOE_AUX_COEF = 0.5
SEQUENCE_KINDS = ("seq-cls-llama", "seq-cls-bert", "peft-seq-cls-llama")


TYPED = "token-typed"  # next-token labels, and token types (zeros: text) the head requires in training
TYPED_IMAGE = "image-typed"  # the image samples as Gemma 3 takes them: pixels of one image, its tokens typed 1
PIXEL_IMAGE = "image-pixels"  # the same images as LLaVA-style heads take them: pixels of one 3 x 4 x 4 image


@functools.lru_cache(maxsize=None)  # the reference asks per micro-batch; an hf: kind's answer is in a file
def task_of(kind: str) -> str:
    """"sequence" (one label per sample, the loss a mean over samples) or "token" (next-token labels); a
    ``hf:<file>`` kind says which in its shrunk config (zerofix.check.usermodel)."""
    if kind.startswith("hf:"):
        import json
        from pathlib import Path

        return json.loads(Path(kind[3:]).read_text()).get("_zerofix_task", "token")
    if kind in ("vlm-image", "qwen3vl-image", "glm4v-image", "qwen35-image"):
        return "image"
    if kind == "gemma3-image":
        return TYPED_IMAGE
    if kind == "vipllava-image":
        return PIXEL_IMAGE
    return "sequence" if kind in SEQUENCE_KINDS else "token"


class TinyNoKwargsLM(nn.Module):
    """Embedding -> MLP -> vocabulary, next-token loss averaged over the micro-batch's counted tokens."""

    def __init__(self, vocab: int = VOCAB, hidden: int = 32, loss_only: bool = False):
        super().__init__()
        self.loss_only = loss_only  # return only the loss (no logits) when labels are given
        self.embed = nn.Embedding(vocab, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh())
        self.head = nn.Linear(hidden, vocab)
        # Small weights, so fp32 rounding of the stored weights stays far below the update.
        nn.init.normal_(self.embed.weight, std=0.1)

    def forward(self, input_ids, labels=None, attention_mask=None):
        logits = self.head(self.mlp(self.embed(input_ids)))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = next_token_ce(logits, labels, "mean")
            if self.loss_only:
                return {"loss": out["loss"]}
        return out


def next_token_ce(logits, labels, reduction: str):
    """Cross-entropy of position t's logits against label t+1, ignoring IGNORE labels."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
                           ignore_index=IGNORE, reduction=reduction)


def build_model(kind: str, seed: int = 0, *, loss_only: bool = False) -> nn.Module:
    """``kind``: one of MODEL_KINDS, or ``hf:<file>``, a shrunk Hugging Face config written by
    ``zerofix.check.usermodel`` (``zerofix check --model``)."""
    if kind.startswith("hf:"):
        import json
        from pathlib import Path

        from zerofix.check import usermodel

        return usermodel.build(json.loads(Path(kind[3:]).read_text()), seed)
    torch.manual_seed(seed)
    if kind == "custom":
        return TinyNoKwargsLM(loss_only=loss_only)
    if kind in ("causal-lm", "seq-cls-llama", "peft-seq-cls-llama"):
        from transformers import LlamaConfig

        config = LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            tie_word_embeddings=False, attn_implementation="eager", num_labels=NUM_LABELS,
        )
        if kind == "causal-lm":
            from transformers import LlamaForCausalLM

            return LlamaForCausalLM(config)
        from transformers import LlamaForSequenceClassification

        model = LlamaForSequenceClassification(config)
        # Set after construction: a pad id in the config gives the embedding a padding_idx row that
        # initialisation zeroes, which fails on a ZeRO-3 partition (the second model a job builds).
        model.config.pad_token_id = 0  # the classifier pools the last token before the padding
        if kind == "peft-seq-cls-llama":
            from peft import LoraConfig, get_peft_model

            # the classifier head trains in full (modules_to_save), the attention projections through LoRA
            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                     task_type="SEQ_CLS", init_lora_weights=False))
        return model
    if kind in ("nokw-llama", "own-mean-llama", "inline-mean-llama", "fused-mean-llama"):
        return _no_count_llama(kind)
    if kind in VLM_KINDS:
        return _tiny_vlm()
    if kind in OWN_MEAN_IMAGE_KINDS:
        return {"qwen3vl-image": _tiny_qwen3_vl, "glm4v-image": _tiny_glm4v, "qwen35-image": _tiny_qwen3_5,
                "gemma3-image": _tiny_gemma3, "vipllava-image": _tiny_vipllava}[kind]()
    if kind == "moe":
        from transformers import MixtralConfig, MixtralForCausalLM

        config = MixtralConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, num_local_experts=4,
            num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=MOE_AUX_COEF,
            router_jitter_noise=0.0, attn_implementation="eager",
        )
        if hasattr(config, "_experts_implementation"):  # 5.x: eager experts (its grouped-mm takes no float64)
            config._experts_implementation = "eager"
        return MixtralForCausalLM(config)
    if kind == "seq-cls-bert":
        from transformers import BertConfig, BertForSequenceClassification

        config = BertConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, num_labels=NUM_LABELS, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, attn_implementation="eager",
        )
        return BertForSequenceClassification(config)
    raise ValueError(f"unknown model kind {kind!r}; choose from {MODEL_KINDS}")


def has_sub_models(kind: str) -> bool:
    """Whether a model of this kind may build parts of itself with ``_from_config`` (a vision-language model; a
    user's config, whose class is not known here): under a live ZeRO-3 configuration those parts are built
    partitioned even when the model itself is not."""
    return kind in VLM_KINDS + OWN_MEAN_IMAGE_KINDS or kind.startswith("hf:")


def _llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False, attn_implementation="eager", num_labels=NUM_LABELS)


def _no_count_llama(kind: str) -> nn.Module:
    """LlamaForCausalLM saying ``accepts_loss_kwargs = False``; ``own-mean-llama`` also drops the count on its way to the
    loss function, ``inline-mean-llama`` computes its token mean inline, ``fused-mean-llama`` also returns no logits."""
    from transformers import LlamaForCausalLM

    class NoCountLlamaForCausalLM(LlamaForCausalLM):
        accepts_loss_kwargs = False

    class OwnMeanLlamaForCausalLM(NoCountLlamaForCausalLM):
        def forward(self, *args, num_items_in_batch=None, **kwargs):
            return super().forward(*args, **kwargs)  # the count is not passed on to the loss function

    class InlineMeanLlamaForCausalLM(NoCountLlamaForCausalLM):
        def forward(self, *args, labels=None, num_items_in_batch=None, **kwargs):
            out = super().forward(*args, **kwargs)
            if labels is not None:  # its own token mean, whatever it is handed (an item: a field that was None)
                out["loss"] = next_token_ce(out.logits.float(), labels, "mean")
            return out

    class FusedMeanLlamaForCausalLM(InlineMeanLlamaForCausalLM):
        def forward(self, *args, labels=None, **kwargs):
            out = super().forward(*args, labels=labels, **kwargs)
            if labels is not None:  # its loss only, as a fused head returns it (no logits to read)
                out = type(out)(loss=out.loss)
            return out

    cls = {"nokw-llama": NoCountLlamaForCausalLM, "own-mean-llama": OwnMeanLlamaForCausalLM,
           "inline-mean-llama": InlineMeanLlamaForCausalLM, "fused-mean-llama": FusedMeanLlamaForCausalLM}[kind]
    return cls(_llama_config())


def _tiny_vlm() -> nn.Module:
    """A tiny Qwen2_5_VLForConditionalGeneration (its image arrays come concatenated over the batch: ``stack``)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=None, attn_implementation="eager"),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           patch_size=2, spatial_merge_size=1, temporal_patch_size=1, in_channels=3, window_size=4,
                           fullatt_block_indexes=[0]),
        image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, tie_word_embeddings=False, attn_implementation="eager")
    return Qwen2_5_VLForConditionalGeneration(config)


def _tiny_qwen3_vl() -> nn.Module:
    """A tiny Qwen3VLForConditionalGeneration taking the image samples of ``vlm-image`` (no deepstack layer)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    config = Qwen3VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                         tie_word_embeddings=False),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=2,
                           spatial_merge_size=1, temporal_patch_size=1, in_channels=3, num_position_embeddings=16,
                           deepstack_visual_indexes=[]),
        image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, tie_word_embeddings=False)
    _set_rope(config.text_config,
              {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    return _eager(Qwen3VLForConditionalGeneration, config)


def _tiny_glm4v() -> nn.Module:
    """A tiny Glm4vForConditionalGeneration taking the image samples of ``vlm-image``."""
    from transformers import Glm4vConfig, Glm4vForConditionalGeneration

    config = Glm4vConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=2,
                           spatial_merge_size=1, temporal_patch_size=1, in_channels=3, image_size=4),
        image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, image_start_token_id=VISION_START,
        image_end_token_id=VISION_END, tie_word_embeddings=False)
    _set_rope(config.text_config, {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]})
    return _eager(Glm4vForConditionalGeneration, config)


def _tiny_qwen3_5() -> nn.Module:
    """A tiny Qwen3_5ForConditionalGeneration (transformers 5.x): one linear-attention and one full-attention layer."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    config = Qwen3_5Config(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                         tie_word_embeddings=False, linear_num_key_heads=2, linear_num_value_heads=2,
                         linear_key_head_dim=8, linear_value_head_dim=8,
                         layer_types=["linear_attention", "full_attention"]),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=2,
                           spatial_merge_size=1, temporal_patch_size=1, in_channels=3, num_position_embeddings=16,
                           deepstack_visual_indexes=[]),
        image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, tie_word_embeddings=False)
    return _eager(Qwen3_5ForConditionalGeneration, config)


def _set_rope(text_config, rope: dict) -> None:
    for key in ("rope_scaling", "rope_parameters"):  # 4.57 names it rope_scaling, 5.x rope_parameters
        if hasattr(text_config, key):
            setattr(text_config, key, dict(rope))


def _eager(cls, config) -> nn.Module:
    for part in (config, getattr(config, "text_config", None), getattr(config, "vision_config", None)):
        if part is not None:
            part._attn_implementation = "eager"
    return cls(config)


def _tiny_gemma3() -> nn.Module:
    """A tiny Gemma3ForConditionalGeneration: a 4x4-pixel image of four 2x2 patches, four image tokens."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    config = Gemma3Config(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                         sliding_window=16),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=4, patch_size=2),
        mm_tokens_per_image=IMAGE_PATCHES, image_token_index=IMAGE_TOKEN, boi_token_index=VISION_START,
        eoi_token_index=VISION_END)
    return _eager(Gemma3ForConditionalGeneration, config)


def _tiny_vipllava() -> nn.Module:
    """A tiny VipLlavaForConditionalGeneration: a CLIP tower reading a 4x4-pixel image of four 2x2 patches (its class
    token dropped: four image tokens), two of its layers projected."""
    from transformers import VipLlavaConfig, VipLlavaForConditionalGeneration

    config = VipLlavaConfig(
        text_config=dict(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False),
        vision_config=dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, image_size=4, patch_size=2, projection_dim=16),
        image_token_index=IMAGE_TOKEN, vision_feature_layers=[-2, -1], projector_layernorm_eps=1e-5)
    return _eager(VipLlavaForConditionalGeneration, config)


def sample(index: int, seed: int = 0, task: str = "token") -> dict:
    """Sample ``index``: random tokens of a random length (so micro-batches count different numbers
    of tokens), right-padded. Labels ignore the padding and position 0: the Trainer counts unshifted
    labels while causal LMs predict shifted ones, and a label at position 0 would make the two differ."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    length = int(torch.randint(3, SEQ + 1, (1,), generator=g))
    ids = torch.randint(1, VOCAB, (SEQ,), generator=g)
    mask = (torch.arange(SEQ) < length).long()
    ids = ids * mask
    labels = ids.masked_fill(mask == 0, IGNORE)
    labels[0] = IGNORE
    if task == "sequence":  # one class per sample, from its tokens
        labels = torch.tensor(int(ids.sum()) % NUM_LABELS)
    if task in ("image", TYPED_IMAGE, PIXEL_IMAGE):  # an image in front: its tokens, never predicted
        ids = ids.clamp(max=IMAGE_TOKEN - 1) * mask
        ids[1:7] = torch.tensor([VISION_START] + [IMAGE_TOKEN] * IMAGE_PATCHES + [VISION_END])
        length = max(length, 8)
        mask = (torch.arange(SEQ) < length).long()
        labels = ids.masked_fill(mask == 0, IGNORE)
        labels[:7] = IGNORE
        pixels = torch.randn(IMAGE_PATCHES, PATCH_VALUES, generator=g)
        if task == TYPED_IMAGE:  # the same values as one 3 x 4 x 4 image; its tokens typed 1 (Gemma 3)
            return {"input_ids": ids, "attention_mask": mask, "labels": labels,
                    "pixel_values": pixels.reshape(1, 3, 4, 4), "token_type_ids": (ids == IMAGE_TOKEN).long()}
        if task == PIXEL_IMAGE:  # the same values as one 3 x 4 x 4 image (LLaVA's heads: VipLlava)
            return {"input_ids": ids, "attention_mask": mask, "labels": labels, "pixel_values": pixels.reshape(1, 3, 4, 4)}
        return {"input_ids": ids, "attention_mask": mask, "labels": labels, "pixel_values": pixels,
                "image_grid_thw": torch.tensor([[1, 2, 2]])}  # one image of 2 x 2 patches
    if task == TYPED:  # a head that requires token types in training (Gemma 3 on 4.57 - 5.3): all text
        return {"input_ids": ids, "attention_mask": mask, "labels": labels, "token_type_ids": torch.zeros_like(ids)}
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


# A VLM's image arrays are concatenated over the batch, as its processor returns them (patches x values, images x 3)
_CONCATENATED = ("pixel_values", "image_grid_thw")


def stack(items) -> dict:
    """Collate dict items into a batch of tensors."""
    return {k: (torch.cat if k in _CONCATENATED else torch.stack)([torch.as_tensor(it[k]) for it in items])
            for k in items[0]}


def collate(indices, seed: int = 0, task: str = "token") -> dict:
    return stack([sample(i, seed, task) for i in indices])


def loss_sum(kind: str, model: nn.Module, batch: dict) -> tuple[torch.Tensor, int]:
    """(sum of the counted items' losses, number of counted items) of one micro-batch, by the kind's task."""
    if task_of(kind) != "sequence":
        return token_loss_sum(model, batch)
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    logits = out["logits"] if isinstance(out, dict) else out.logits
    return F.cross_entropy(logits, batch["labels"], reduction="sum"), int(batch["labels"].numel())


@functools.lru_cache(maxsize=None)
def loss_of(kind: str) -> str | None:
    """"moe" for a kind whose loss adds a router auxiliary loss (``moe``, or an ``hf:`` MoE that says so)."""
    if kind.startswith("hf:"):
        import json
        from pathlib import Path

        return json.loads(Path(kind[3:]).read_text()).get("_zerofix_loss")
    return "moe" if kind == "moe" else None


def moe_losses(model: nn.Module, batch: dict) -> tuple[torch.Tensor, int, torch.Tensor]:
    """(sum of next-token cross-entropies, number of counted tokens, the router's auxiliary loss) of one
    micro-batch of a ``moe`` model."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True)
    ce = next_token_ce(out.logits, batch["labels"], "sum")
    return ce, int((batch["labels"][:, 1:] != IGNORE).sum()), out.aux_loss


def token_loss_sum(model: nn.Module, batch: dict) -> tuple[torch.Tensor, int]:
    """(sum of next-token cross-entropies, number of counted tokens) of one micro-batch."""
    # a VLM sample's image; the token types a head requires in training
    extra = {k: batch[k] for k in ("pixel_values", "image_grid_thw", "token_type_ids") if k in batch}
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **extra)
    logits = out["logits"] if isinstance(out, dict) else out.logits
    return next_token_ce(logits, batch["labels"], "sum"), int((batch["labels"][:, 1:] != IGNORE).sum())


def smoothed_loss_sum(model: nn.Module, batch: dict, epsilon: float) -> tuple[torch.Tensor, int]:
    """(sum of the label-smoothed token losses, number of counted tokens) of one micro-batch, as transformers'
    LabelSmoother computes them: ``(1 - epsilon) * nll + epsilon * mean over the vocabulary of -log p`` per counted
    token, the labels shifted only for a class transformers maps as a causal LM (a subclass of one is not: the Trainer
    reads the class name)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    logits, labels = (out["logits"] if isinstance(out, dict) else out.logits), batch["labels"]
    if type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        logits, labels = logits[:, :-1], labels[:, 1:]
    neg_log_p = -F.log_softmax(logits.float(), dim=-1)
    counted = labels != IGNORE
    nll = neg_log_p.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    per_token = (1 - epsilon) * nll + epsilon * neg_log_p.mean(-1)
    return per_token[counted].sum(), int(counted.sum())


class IndexedDataset(torch.utils.data.Dataset):
    """Items carry their index so the training script can record exactly what each rank consumed."""

    def __init__(self, size: int, seed: int = 0, task: str = "token"):
        self.size, self.seed, self.task = size, seed, task

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return {"sample_idx": index, **sample(index, self.seed, self.task)}
