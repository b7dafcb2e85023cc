"""Which Hugging Face heads does the installed Trainer scale wrongly? One line per head family, measured.

For each head (tiny random model, nothing downloaded): whether the release's Trainer guesses that its loss is
normalised by ``num_items_in_batch`` (the forward's signature, as ``Trainer.__init__`` reads it), and whether
its loss actually reads the count (a forward with labels and a watched count, ``zerofix.num_items_watch``). A
head the Trainer believes normalised whose loss never reads the count is scaled GAS x (and x processes) too
large by every release from 4.46 (``transformers-trainer-scaling`` corrects it); a head whose forward takes no
``**kwargs`` is divided by the Trainer as a mean, right from 4.48.

    .venvs/<stack>/bin/python tools/head_survey.py        # a markdown table (docs/fixes.md has one per stack)
"""
from __future__ import annotations

import inspect

import torch
import transformers

from zerofix import num_items_watch, scaling
from zerofix.fixes import trainer_scaling

B, T, V, GAS = 2, 8, 64, 4


def _llama(cls_name, **extra):
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, **extra)
    return getattr(transformers, cls_name)(cfg)


def _bert(cls_name, **extra):
    cfg = transformers.BertConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, max_position_embeddings=32, **extra)
    return getattr(transformers, cls_name)(cfg)


def _t5(cls_name):
    cfg = transformers.T5Config(vocab_size=V, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8,
                                decoder_start_token_id=0)
    return getattr(transformers, cls_name)(cfg)


def _ids(*shape):
    return torch.randint(1, V, shape)


# family -> [(class, builder, inputs with labels)]
HEADS = {
    "causal LM (the right path)": [("LlamaForCausalLM", _llama, lambda: {"input_ids": _ids(B, T), "labels": _ids(B, T)})],
    "sequence classification": [
        ("LlamaForSequenceClassification", lambda c: _llama(c, num_labels=3),
         lambda: {"input_ids": _ids(B, T), "labels": torch.tensor([0, 2])}),
        ("BertForSequenceClassification", lambda c: _bert(c, num_labels=3),
         lambda: {"input_ids": _ids(B, T), "labels": torch.tensor([0, 2])})],
    "token classification": [
        ("LlamaForTokenClassification", lambda c: _llama(c, num_labels=3),
         lambda: {"input_ids": _ids(B, T), "labels": torch.randint(0, 3, (B, T))}),
        ("BertForTokenClassification", lambda c: _bert(c, num_labels=3),
         lambda: {"input_ids": _ids(B, T), "labels": torch.randint(0, 3, (B, T))})],
    "masked LM": [("BertForMaskedLM", _bert, lambda: {"input_ids": _ids(B, T), "labels": _ids(B, T)})],
    "question answering": [
        ("LlamaForQuestionAnswering", _llama,
         lambda: {"input_ids": _ids(B, T), "start_positions": torch.tensor([1, 2]), "end_positions": torch.tensor([3, 4])}),
        ("BertForQuestionAnswering", _bert,
         lambda: {"input_ids": _ids(B, T), "start_positions": torch.tensor([1, 2]), "end_positions": torch.tensor([3, 4])})],
    "multiple choice": [("BertForMultipleChoice", _bert, lambda: {"input_ids": _ids(B, 2, T), "labels": torch.tensor([0, 1])})],
    "seq2seq": [("T5ForConditionalGeneration", _t5, lambda: {"input_ids": _ids(B, T), "labels": _ids(B, T)})],
}


def unpatched_factor(guess: bool, has_labels: bool, reads: bool | None) -> float:
    """The Trainer's update / the right one for this head, 1 process, no DeepSpeed, GAS=4: the release's rules
    (zerofix.scaling, held against real runs in tests/test_trainer_scaling.py) with the measured verdict. The
    Trainer counts items only where a batch has ``labels`` (no count: the loss cannot be normalised by it)."""
    release = trainer_scaling.release()
    facts = scaling.TrainerFacts(accepts_loss_kwargs=guess, compute_loss_func=False, num_items=guess and has_labels,
                                 average_tokens=release >= (4, 49), loss_is_scaled_for_ga=None, processes=1, gas=GAS,
                                 window=GAS)
    accelerate = GAS if (5, 2) <= release[:2] and release < (5, 5, 4) else 1
    verdict = (num_items_watch.DIVIDED if reads else num_items_watch.INDEPENDENT) if reads is not None else None
    call = scaling.call_of(release, facts, verdict=verdict if facts.num_items else None, stated=False,
                           base_ran=True, deepspeed=False, scale_wrt_gas=False, accelerate_steps=accelerate)
    return float(scaling.applied_factor(call, scaling.Plan()))


def survey() -> list[tuple[str, ...]]:
    rows = []
    for family, heads in HEADS.items():
        for cls_name, build, inputs in heads:
            if getattr(transformers, cls_name, None) is None:
                rows.append((family, cls_name, "absent", "", ""))
                continue
            torch.manual_seed(0)
            model = build(cls_name)
            guess = trainer_scaling.trainer_guess(model)
            takes = any(p.kind == inspect.Parameter.VAR_KEYWORD
                        for p in inspect.signature(model.forward).parameters.values())
            batch = inputs()
            reads = None
            if takes:
                watched = num_items_watch.watch(torch.tensor(B * T))
                try:
                    with torch.no_grad():
                        out = model(**batch, num_items_in_batch=watched)
                    verdict = num_items_watch.decide(out.loss)
                finally:
                    num_items_watch.close()
                reads = verdict.state != num_items_watch.INDEPENDENT
            loss = "no **kwargs" if not takes else ("reads the count" if reads else "ignores the count")
            if takes and "labels" not in batch:
                loss += " (no `labels`: the Trainer counts nothing)"
            factor = unpatched_factor(guess, "labels" in batch, reads)
            rows.append((family, cls_name, "normalised" if guess else "a mean", loss,
                         f"**{factor:g}**" if factor != 1 else "1"))
    return rows


def main() -> None:
    print(f"transformers {transformers.__version__}\n")
    print("| family | class | the Trainer believes its loss | its loss, measured | unpatched update / right, 1 process, GAS=4 |")
    print("|---|---|---|---|---|")
    for row in survey():
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
