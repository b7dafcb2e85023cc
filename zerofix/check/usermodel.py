"""``zerofix check --model PATH``: a tiny, randomly initialised model of the *same architecture class* as the
user's (same ``model_type``, same class, same tied or untied head, so the same loss), built from a local Hugging
Face config or model directory with every size shrunk. Nothing is downloaded and no weight is read: only
``config.json``. The class is a causal LM (next-token labels) or a sequence classifier (one class per sample,
``num_labels`` set to the check's): the heads whose samples the check makes.

The shrunk config is written to a JSON file; the check's scenarios and its reference build the model from it
(``zerofix.check.models.build_model("hf:<file>")``).
"""
from __future__ import annotations

import json
from pathlib import Path

from zerofix.check.userconfig import HIDDEN, ConfigError

VOCAB = 64  # zerofix.check.models.VOCAB: the samples' token ids are below it
NUM_LABELS = 3  # zerofix.check.models.NUM_LABELS: the samples' classes (tests/test_check_own_config.py ties the two)
TYPED = "token-typed"  # zerofix.check.models.TYPED: a head that requires token types in training (the same test ties it)
# Sizes, by every name the architectures in transformers use for them
SHRINK = {
    ("hidden_size", "n_embd", "d_model"): HIDDEN,
    ("intermediate_size", "n_inner", "ffn_dim"): 2 * HIDDEN,
    ("num_hidden_layers", "n_layer", "num_layers"): 2,
    ("num_attention_heads", "n_head"): 4,
    ("num_key_value_heads",): 2,
    ("head_dim",): HIDDEN // 4,
    ("vocab_size",): VOCAB,
    ("max_position_embeddings", "n_positions", "n_ctx"): 64,
    ("moe_intermediate_size", "shared_expert_intermediate_size"): HIDDEN,
    ("num_experts", "num_local_experts", "n_routed_experts"): 4,
    ("num_experts_per_tok",): 2,
    # Gemma 3n / Gemma 4's per-layer inputs: an embedding of the whole vocabulary per layer
    ("vocab_size_per_layer_input",): VOCAB,
    ("hidden_size_per_layer_input",): HIDDEN // 4,
}
SPECIAL_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
DROPPED = ("quantization_config", "torch_dtype", "dtype", "_name_or_path", "auto_map", "transformers_version",
           "id2label", "label2id")


def config_file(path) -> Path:
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"--model {path}: no such file; give a model directory with a config.json, or the config "
                          "file itself (nothing is downloaded)")
    return path


def shrink(path) -> dict:
    """The user's config with every size shrunk (sizes as in ``SHRINK``), its special tokens inside the tiny
    vocabulary, dropout off, eager attention, float32. Raises ConfigError for a config that is not a causal LM's."""
    source = config_file(path)
    try:
        config = json.loads(source.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--model {source}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ConfigError(f"--model {source}: no model_type; give a Hugging Face model's config.json")
    shrunk = _shrunk_sizes({k: v for k, v in config.items() if k not in DROPPED})
    for tower in TOWERS:  # a multimodal model (issue 47: the VLMs the Trainer never hands the count): one small layer
        if isinstance(shrunk.get(tower), dict):
            shrunk[tower] = _shrunk_tower(shrunk[tower])
    if isinstance(shrunk.get("text_config"), dict):
        shrunk["text_config"] = _fit_default_mrope(_shrunk_sizes(dict(shrunk["text_config"])))
        for name, value in list(shrunk["text_config"].items()):
            if ("dropout" in name or "pdrop" in name) and isinstance(value, float):
                shrunk["text_config"][name] = 0.0
            if name in SPECIAL_TOKENS:
                shrunk["text_config"][name] = SPECIAL_TOKENS[name]
    for name, value in SPECIAL_TOKENS.items():
        if name in shrunk:
            shrunk[name] = value
    for name, value in list(shrunk.items()):
        # dropout off: the reference repeats the run's function in another process, without its random masks
        if ("dropout" in name or "pdrop" in name) and isinstance(value, float):
            shrunk[name] = 0.0
    shrunk["attn_implementation"] = "eager"
    shrunk["_zerofix_source"] = str(source)
    if task_of_class(architecture(shrunk)) == "sequence":
        shrunk.update(num_labels=NUM_LABELS, problem_type="single_label_classification")
        shrunk["_zerofix_task"] = "sequence"
    return shrunk


TOWERS = ("vision_config", "audio_config", "video_config")


def _shrunk_sizes(config: dict) -> dict:
    """``config`` (one level) with every size of SHRINK shrunk, its layer kinds and multimodal RoPE sections to fit."""
    for names, value in SHRINK.items():
        for name in names:
            if name in config and config[name] is not None:
                config[name] = value
    layers = config.get("num_hidden_layers", config.get("n_layer", 2))
    if isinstance(config.get("layer_types"), list) and config["layer_types"]:
        # per-layer attention kinds (Qwen2, Gemma, Qwen3.5's linear and full attention): one layer of each kind
        source_kinds = list(config["layer_types"])
        kinds = list(dict.fromkeys(source_kinds))
        config["layer_types"] = (kinds + [kinds[-1]] * layers)[:max(layers, len(kinds))]
        if "num_hidden_layers" in config:
            config["num_hidden_layers"] = len(config["layer_types"])
        if isinstance(config.get("per_layer_config"), dict):  # Gemma 4: by layer index; the first layer of its kind
            config["per_layer_config"] = _per_layer_config(config["per_layer_config"], source_kinds,
                                                           config["layer_types"])
    for key in ("rope_scaling", "rope_parameters"):
        rope = config.get(key)
        if isinstance(rope, dict) and "mrope_section" in rope:
            rope["mrope_section"] = _mrope_sections(config, rope, len(rope["mrope_section"]) or 3)
    return config


def _per_layer_config(per_layer: dict, source_kinds: list, kinds: list) -> dict:
    """Per-layer overrides (``{"05": {"head_dim": 512}}``) moved to the shrunk layer of the same kind, their sizes
    shrunk as the model's are."""
    out = {}
    for index, override in per_layer.items():
        try:
            kind = source_kinds[int(index)]
        except (ValueError, IndexError):
            continue
        if kind in kinds and isinstance(override, dict):
            out[str(kinds.index(kind))] = _shrunk_sizes(dict(override))
    return out


def _rope_dim(config: dict, rope: dict) -> int:
    """The rotary dimension of a head: head_dim times the partial rotary factor (where the config says one)."""
    head = config.get("head_dim") or config.get("hidden_size", HIDDEN) // config.get("num_attention_heads", 4)
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) or 1.0
    return int(head * partial)


def _mrope_sections(config: dict, rope: dict, parts: int) -> list[int]:
    """Multimodal RoPE sections that fill half the tiny head's rotary dimension, as the source's fill its own."""
    half = max(_rope_dim(config, rope) // 2, parts)
    return [half // parts + (1 if i < half % parts else 0) for i in range(parts)]


def _fit_default_mrope(text: dict) -> dict:
    """A text config whose class reads ``mrope_section`` from its rope parameters with a default sized for the
    full-size head (Qwen2.5-VL's [16, 24, 24], GLM-4V's [8, 12, 12]) and a config that leaves it out (a config as
    transformers ships it): the sections written in, fitted to the tiny head. Which classes read it is their own
    declaration (``ignore_keys_at_rope_validation``), not a list of names."""
    try:
        from transformers import CONFIG_MAPPING

        cls = CONFIG_MAPPING[text.get("model_type")]
    except (ImportError, KeyError):
        return text
    if "mrope_section" not in getattr(cls, "ignore_keys_at_rope_validation", ()):
        return text
    key = "rope_parameters" if "rope_parameters" in text or "rope_scaling" not in text else "rope_scaling"
    rope = dict(text.get(key) or {"rope_type": "default"})
    if "rope_theta" in text and "rope_theta" not in rope:
        rope["rope_theta"] = text["rope_theta"]
    if "mrope_section" not in rope and isinstance(rope.get("rope_type", "default"), str):
        # keep the head's rotary half at least one element per section
        while _rope_dim(text, rope) // 2 < 3 and "head_dim" in text:
            text["head_dim"] *= 2
        rope["mrope_section"] = _mrope_sections(text, rope, 3)
        text[key] = rope
    return text


def _shrunk_tower(config: dict) -> dict:
    """A vision or audio tower: one layer, the text model's width at its output."""
    config = dict(config)
    for name in ("depth", "num_hidden_layers", "num_layers"):
        if isinstance(config.get(name), int):
            config[name] = 1
    for name, value in (("hidden_size", HIDDEN), ("embed_dim", HIDDEN), ("intermediate_size", 2 * HIDDEN),
                        ("num_heads", 2), ("num_attention_heads", 2), ("out_hidden_size", HIDDEN)):
        if isinstance(config.get(name), int):
            config[name] = value
    return config


def _class_names(mapping) -> set[str]:
    names = set()
    for value in mapping.values():
        names.update([value] if isinstance(value, str) else value)
    return names


def task_of_class(cls) -> str:
    """"token" for a causal LM, "sequence" for a sequence classifier (what the check's samples are for)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    return "sequence" if cls.__name__ in _class_names(MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES) else "token"


def architecture(config: dict):
    """The class the config names (``architectures``): a causal LM or a sequence classifier transformers has;
    transformers' causal-LM class for its ``model_type`` when it names none. Raises ConfigError otherwise."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto import modeling_auto
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES)

    model_type = config["model_type"]
    try:
        AutoConfig.for_model(model_type)
    except (ValueError, KeyError):
        raise ConfigError(f"--model: model_type {model_type!r} is unknown to transformers {transformers.__version__}; "
                          "install a transformers release that has it") from None
    # causal LMs, sequence classifiers, and the image-text-to-text heads (trained on text-only samples here)
    multimodal = getattr(modeling_auto, "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", {})
    trainable = (_class_names(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | _class_names(MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES)
                 | _class_names(multimodal))
    named = list(config.get("architectures") or ())
    if not named:
        default = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
        named = [default] if isinstance(default, str) else list(default or ())
    for name in named:
        if name in trainable and getattr(transformers, name, None) is not None:
            return getattr(transformers, name)
    raise ConfigError(f"--model: {', '.join(named) or model_type} is neither a causal language model nor a sequence "
                      f"classifier transformers {transformers.__version__} can build; zerofix check trains those two "
                      "(next-token labels, one class per sample): give the config of one of them")


def build(config: dict, seed: int = 0):
    """A randomly initialised model of the config's class (float32)."""
    import torch
    from transformers import AutoConfig

    fields = {k: v for k, v in config.items() if not k.startswith("_zerofix")}
    cls = architecture(fields)
    model_type = fields.pop("model_type")
    defaults = AutoConfig.for_model(model_type).to_dict()
    for names, value in SHRINK.items():  # sizes the user's file leaves to the class's defaults (GPT-2's 1024 positions)
        for name in names:
            if name not in fields and defaults.get(name) is not None:
                fields[name] = value
    for name, value in SPECIAL_TOKENS.items():  # GPT-2's default eos 50256 is outside the tiny vocabulary
        if name not in fields and isinstance(defaults.get(name), int) and defaults[name] >= VOCAB:
            fields[name] = value
    torch.manual_seed(seed)
    hf_config = AutoConfig.for_model(model_type, **fields)
    for name, value in hf_config.to_dict().items():  # the class's defaults too (GPT-2: resid_pdrop=0.1)
        if ("dropout" in name or "pdrop" in name) and isinstance(value, float):
            setattr(hf_config, name, 0.0)
    if hasattr(hf_config, "_experts_implementation"):  # 5.x MoE: eager experts (its grouped-mm takes no float64)
        hf_config._experts_implementation = "eager"
    model = cls(hf_config).float()
    if task_of_class(cls) == "sequence" and getattr(model.config, "pad_token_id", None) is None:
        # set after construction, as models.build_model does: the classifier pools the last token before padding
        model.config.pad_token_id = SPECIAL_TOKENS["pad_token_id"]
    return model


def _adds_router_loss(model) -> bool:
    """Whether the model's loss adds a router auxiliary loss (an MoE causal LM with output_router_logits): asked of
    one forward with labels, not of the class."""
    import torch

    if not hasattr(model, "router_aux_loss_coef") or task_of_class(type(model)) != "token":
        return False
    ids = torch.randint(1, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    return getattr(out, "aux_loss", None) is not None


def _needs_token_types(model) -> bool:
    """Whether the tiny model's forward refuses a text batch with labels in training without ``token_type_ids`` (Gemma 3
    on transformers 4.57 - 5.3: "token_type_ids is required as a model input when training"): read from its behaviour."""
    import torch

    ids = torch.arange(2 * 8).reshape(2, 8) % (VOCAB - 1) + 1
    model.train()
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
    except Exception as exc:  # noqa: BLE001 - any refusal naming the token types
        return "token_type_ids" in str(exc)
    return False


def prepare(path, out_dir: Path) -> tuple[str, dict]:
    """Shrink the config, build the tiny model once (a config that cannot be built is a usage error now, not
    a failed row later), write the shrunk config; return (model kind "hf:<file>", a description)."""
    config = shrink(path)
    try:
        model = build(config)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of the class's own __init__ is the user's answer
        raise ConfigError(f"--model {path}: a tiny {config['model_type']} could not be built "
                          f"({type(exc).__name__}: {exc})") from None
    if _adds_router_loss(model):
        config["_zerofix_loss"] = "moe"  # the reference weights the router's auxiliary loss as one big batch
    if config.get("_zerofix_task", "token") == "token" and _needs_token_types(model):
        config["_zerofix_task"] = TYPED
    out_dir.mkdir(parents=True, exist_ok=True)
    file = out_dir / "tiny-model-config.json"
    file.write_text(json.dumps(config, indent=1))
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    described = {"class": type(model).__name__, "model_type": config["model_type"], "tied_head": tied,
                 "task": config.get("_zerofix_task", "token"), "moe": config.get("_zerofix_loss") == "moe",
                 "parameters": sum(p.numel() for p in model.parameters()), "source": config["_zerofix_source"]}
    return f"hf:{file}", described
