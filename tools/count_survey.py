"""Which generation heads does the installed Trainer never hand ``num_items_in_batch``, and what does their loss do
with it when handed? Measured per class (issue 47), nothing downloaded.

The Trainer counts and passes the count only to a model whose ``accepts_loss_kwargs`` says so (or, without the
attribute, whose forward takes ``**kwargs``). For every causal-LM and image/video/audio-text-to-text head class of
the installed transformers that says ``accepts_loss_kwargs = False``, this builds a tiny random instance from its
config class's defaults (every size shrunk, sub-configs too), runs one forward on text-only samples with labels and
a watched count (``zerofix.num_items_watch``), and prints the verdict: ``divided`` (zerofix hands it the count and
the update becomes the window's token mean), ``divided through its loss_function`` (the count handed on to the loss
function the head calls), ``its own mean, weighed`` (an inline mean proven from the logits the head returns and
weighed by its tokens over the count: ``zerofix.own_mean``), ``independent`` (its forward computes its own mean and
nothing proves it: the mean of micro-batch means stays), ``unknown``, or ``not built`` (the tiny instance or its forward
failed here; the reason).

    .venvs/<stack>/bin/python tools/count_survey.py            # the Markdown table of docs/count-survey.md
    .venvs/<stack>/bin/python tools/count_survey.py --check    # exit 1 when the docs' table for this stack differs
    .venvs/<stack>/bin/python tools/count_survey.py --write    # replace this stack's section of the docs

tests/test_count_survey.py regenerates the table on each stack that has one in the docs.
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import io
import re
import sys
import warnings
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "count-survey.md"
MAPPINGS = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
            "MODEL_FOR_VISION_2_SEQ_MAPPING_NAMES", "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES")
HIDDEN, VOCAB, B, T = 32, 128, 2, 12
# sizes by the names configs use; a vision/audio sub-config gets one layer
SIZES = {"hidden_size": HIDDEN, "d_model": HIDDEN, "n_embd": HIDDEN, "intermediate_size": 2 * HIDDEN,
         "ffn_dim": 2 * HIDDEN, "num_hidden_layers": 2, "num_layers": 2, "n_layer": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": HIDDEN // 4, "num_heads": 2, "vocab_size": VOCAB,
         "max_position_embeddings": 128, "moe_intermediate_size": HIDDEN, "shared_expert_intermediate_size": HIDDEN,
         "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
         "out_hidden_size": HIDDEN, "depth": 1, "embed_dim": HIDDEN, "projection_dim": HIDDEN,
         "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": VOCAB}
TOWERS = ("vision_config", "audio_config", "video_config", "image_config", "speech_config")


def head_classes() -> list[str]:
    """Every generation head class the auto mappings name, present in the installed transformers."""
    import transformers
    from transformers.models.auto import modeling_auto

    names = set()
    for mapping in MAPPINGS:
        for value in (getattr(modeling_auto, mapping, None) or {}).values():
            names.update(value if isinstance(value, (list, tuple)) else [value])
    return sorted(n for n in names if _safe_get(transformers, n) is not None)


def _safe_get(module, name):
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return getattr(module, name, None)
    except Exception:  # noqa: BLE001 - a class whose optional dependency is missing
        return None


def says_no_count(cls) -> bool:
    """The class's own ``accepts_loss_kwargs`` (the Trainer reads it before the signature) is False."""
    return getattr(cls, "accepts_loss_kwargs", None) is False


def _shrink(config, tower: bool = False) -> None:
    from transformers import PretrainedConfig

    for name, value in list(vars(config).items()):
        if isinstance(value, PretrainedConfig):
            _shrink(value, tower=tower or name in TOWERS)
        elif name in SIZES and isinstance(value, int) and not isinstance(value, bool):
            size = SIZES[name]
            if tower and name in ("num_hidden_layers", "num_layers", "depth"):
                size = 1
            setattr(config, name, size)
        elif "dropout" in name and isinstance(value, float):
            setattr(config, name, 0.0)
    layers = getattr(config, "num_hidden_layers", None)
    kinds = getattr(config, "layer_types", None)
    if isinstance(kinds, list) and kinds and isinstance(layers, int):  # one layer of each kind, in order
        distinct = list(dict.fromkeys(kinds))
        config.layer_types = (distinct + [distinct[-1]] * layers)[:max(layers, len(distinct))]
        config.num_hidden_layers = len(config.layer_types)
    for attr in ("rope_scaling", "rope_parameters"):
        if not hasattr(config, attr) or tower:
            continue
        rope = getattr(config, attr)
        if rope is None and attr == "rope_scaling" and "VL" in type(config).__name__:  # 4.57 reads the sections here
            rope = {"type": "mrope", "rope_type": "default"}
            setattr(config, attr, rope)
        if isinstance(rope, dict):  # multimodal RoPE's sections must fill the tiny head_dim / 2
            rope["mrope_section"] = [2, 1, 1]


def tiny(cls):
    """A tiny random instance of ``cls`` from its config class's defaults, every size shrunk."""
    import torch

    config = cls.config_class()
    _shrink(config)
    with contextlib.suppress(Exception):
        config._attn_implementation = "eager"
    for sub in ("text_config",):
        if hasattr(config, sub):
            with contextlib.suppress(Exception):
                getattr(config, sub)._attn_implementation = "eager"
    torch.manual_seed(0)
    return cls(config).eval()


THROUGH_LOSS_FUNCTION = "divided through its loss_function"  # issue 59: the count handed to the loss the head calls
OWN_MEAN_WEIGHED = "its own mean, weighed"  # issue 59: an inline mean proven from its logits (zerofix.own_mean)


def verdict_of(cls) -> str:
    """``divided`` / ``independent`` / ``unknown`` for a forward with labels and a watched count, or ``not built``; a head
    whose forward drops the count is asked again with the count handed to the loss function it calls, as the Trainer
    entry does in a handed step (``trainer_scaling.CountToLoss``): THROUGH_LOSS_FUNCTION where that loss is divided."""
    import torch

    from zerofix import num_items_watch
    from zerofix.fixes.trainer_scaling import CountToLoss

    try:
        model = tiny(cls)
    except Exception as exc:  # noqa: BLE001 - what failed is the row's reason
        return f"not built: {type(exc).__name__}"
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (B, T), generator=g)
    labels = ids.clone()
    labels[0, 8:] = -100  # uneven counts
    counted = torch.tensor(int((labels[:, 1:] != -100).sum()))
    verdict, weighed = None, []
    for to_loss in (False, True):
        count = num_items_watch.watch(counted)
        try:
            with torch.no_grad(), CountToLoss(model if to_loss else None,
                                              proven=lambda name, proof: weighed.append(proof is not None)):
                out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels, num_items_in_batch=count)
            loss = out["loss"] if isinstance(out, dict) else out[0]
            verdict = num_items_watch.decide(loss).state
        except Exception as exc:  # noqa: BLE001
            return f"not built: forward {type(exc).__name__}"
        finally:
            num_items_watch.close()
        if verdict != "independent":
            break
        if to_loss is False:
            continue
    if verdict == "divided" and to_loss:
        return OWN_MEAN_WEIGHED if any(weighed) else THROUGH_LOSS_FUNCTION
    return verdict


def survey() -> list[tuple[str, str]]:
    import transformers

    rows = []
    for name in head_classes():
        cls = _safe_get(transformers, name)
        if cls is not None and says_no_count(cls):
            rows.append((name, _quietly(verdict_of, cls)))
    return rows


def _quietly(fn, *args):
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        return fn(*args)


def _calls(source: str, name: str) -> list[str]:
    """The argument text of every call ``name(...)`` in ``source`` (parentheses balanced)."""
    found, start = [], 0
    while (at := source.find(name + "(", start)) >= 0:
        depth, i = 0, at + len(name)
        for i in range(at + len(name), len(source)):
            depth += {"(": 1, ")": -1}.get(source[i], 0)
            if depth == 0:
                break
        found.append(source[at + len(name) + 1:i])
        start = i
    return found


def computes_its_loss_without_the_count(cls) -> bool:
    """Issue 69, item 3: whether a head the Trainer hands the count computes its loss in its own ``forward`` without
    passing the count on: a ``loss_function(...)`` call with neither ``**kwargs`` nor ``num_items_in_batch`` (VipLlava's
    pattern), or an inline cross-entropy. Read from the source only to choose what to measure; the table's verdict is
    measured (``verdict_of``)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    calls = _calls(source, "loss_function")
    dropped = any("**" not in args and "num_items_in_batch" not in args for args in calls)
    inline = "CrossEntropyLoss(" in source or "cross_entropy(" in source
    return dropped or inline


def handed_survey() -> tuple[list[tuple[str, str]], int]:
    """The heads the Trainer hands the count whose forward computes its loss without it: (rows, heads read)."""
    import transformers

    rows, read = [], 0
    for name in head_classes():
        cls = _safe_get(transformers, name)
        if cls is None or says_no_count(cls):
            continue
        read += 1
        if computes_its_loss_without_the_count(cls):
            rows.append((name, _quietly(verdict_of, cls)))
    return rows, read


def table(rows, others: int) -> str:
    import transformers

    lines = [f"### transformers {transformers.__version__}", "",
             f"{len(rows)} head classes say `accepts_loss_kwargs = False` (the Trainer neither counts nor passes the "
             f"count); {others} other generation heads get it from the Trainer.", "",
             "| head class | loss when handed the count | with zerofix |", "|---|---|---|"]
    effect = {"divided": "the window's token mean",
              THROUGH_LOSS_FUNCTION: "the window's token mean (zerofix hands the count to the loss function it calls)",
              OWN_MEAN_WEIGHED: "the window's token mean (zerofix proves its mean from the logits it returns and "
                                "weighs it by its tokens over the count)",
              "independent": "the mean of means stays, said at WARNING where micro-batches count differently",
              "unknown": "the mean of means stays, said at WARNING"}
    for name, verdict in rows:
        lines.append(f"| `{name}` | {verdict} | {effect.get(verdict, 'decided at the first step of a run')} |")
    return "\n".join(lines) + "\n"


def handed_table(rows, read: int) -> str:
    """Issue 69, item 3: the heads the Trainer hands the count, by what their forward does with it."""
    lines = ["", "#### The heads it hands the count whose forward computes the loss without it", "",
             f"Of the {read} heads the Trainer hands the count, {len(rows)} compute their loss in their own forward "
             "without passing it on (a `loss_function` call without it, or an inline cross-entropy; read from the "
             "source, then measured as above); in the others' forwards the source shows no such call.", ""]
    if not rows:
        return "\n".join(lines) + "\n"
    lines += ["| head class | loss when handed the count | with zerofix |", "|---|---|---|"]
    effect = {"divided": "the window's token mean, as upstream (the count reaches its loss another way)",
              THROUGH_LOSS_FUNCTION: "the window's token mean (zerofix hands the count on to the loss function it "
                                     "calls, in windows whose micro-batches count unlike)",
              OWN_MEAN_WEIGHED: "the window's token mean (its inline mean proven from its logits and weighed)",
              # the Trainer, believing the count reaches the loss, divides by nothing: upstream sums GAS micro-batch means
              "independent": "the mean of means (upstream: GAS times it), said at WARNING where micro-batches count "
                             "differently",
              "unknown": "upstream's update, said at WARNING"}
    for name, verdict in rows:
        lines.append(f"| `{name}` | {verdict} | {effect.get(verdict, 'decided at the first step of a run')} |")
    return "\n".join(lines) + "\n"


def current() -> str:
    rows = survey()
    return table(rows, len(head_classes()) - len(rows)) + handed_table(*handed_survey())


def documented(version: str) -> str | None:
    """The docs' table for ``version``, or None."""
    if not DOC.exists():
        return None
    text = DOC.read_text()
    match = re.search(rf"(### transformers {re.escape(version)}\n.*?)(?=\n### |\Z)", text, re.S)
    return match.group(1).rstrip("\n") + "\n" if match else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 when docs/count-survey.md's table differs")
    p.add_argument("--write", action="store_true", help="write this stack's section into docs/count-survey.md")
    args = p.parse_args(argv)
    import resource

    # a class whose sizes this shrinking misses asks for terabytes: a MemoryError (its row says so), not the OOM killer
    resource.setrlimit(resource.RLIMIT_AS, (16 * 2**30, resource.RLIM_INFINITY))
    import transformers

    text = current()
    if args.write:
        doc, old = DOC.read_text(), documented(transformers.__version__)
        if old is None:
            raise SystemExit(f"docs/count-survey.md has no section for transformers {transformers.__version__}")
        DOC.write_text(doc.replace(old, text, 1))
    if not args.check:
        sys.stdout.write(text)
        return 0
    doc = documented(transformers.__version__)
    if doc != text:
        sys.stdout.write(f"docs/count-survey.md's table for transformers {transformers.__version__} differs from the "
                         f"measured one:\n{text}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
