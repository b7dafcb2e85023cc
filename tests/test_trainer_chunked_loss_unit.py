"""transformers-trainer-chunked-loss without a distributed run: which models the probe routes and why not, that a
routed training loss and its gradients equal the model's own, and what the switch leaves alone (evaluation, a batch
without labels, generation, a forward another library set)."""
from __future__ import annotations

import tempfile

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from zerofix.check import models  # noqa: E402
from zerofix.fixes import trainer_chunked_loss as fix  # noqa: E402

pytestmark = pytest.mark.stack("latest", "2026-04", "2025-10")  # the tiny Qwen2.5-VL needs transformers >= 4.49


def batch(kind="causal-lm", n=2):
    return models.collate(list(range(n)), task=models.task_of(kind))


def trainer_for(model):
    args = transformers.TrainingArguments(output_dir=tempfile.mkdtemp(), use_cpu=True, report_to="none",
                                          per_device_train_batch_size=2)
    return transformers.Trainer(model=model, args=args)


def loss_and_grads(trainer, model, inputs, routed: bool):
    model.zero_grad()
    model.train()
    original = lambda *a, **k: transformers.Trainer.compute_loss(trainer, *a, **k)  # noqa: E731
    call = (lambda: fix.compute_loss(original, trainer, (model, dict(inputs)), {})) if routed else \
        (lambda: original(model, dict(inputs)))
    loss = call()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["causal-lm", "vlm", "vlm-image"])
def test_a_routed_loss_and_its_gradients_are_the_models_own(kind):
    model = models.build_model(kind)
    trainer = trainer_for(model)
    inputs = batch(kind)
    own, own_grads = loss_and_grads(trainer, model, inputs, routed=False)
    fix.reset_runtime()
    routed, grads = loss_and_grads(trainer, model, inputs, routed=True)
    assert fix.runtime_details()[0]["routed"] and fix.runtime_details()[0]["steps"] == 1, fix.runtime_details()
    assert torch.allclose(routed, own, rtol=1e-6), (routed, own)
    for name, grad in own_grads.items():
        assert torch.allclose(grads[name], grad, rtol=1e-4, atol=1e-7), name
    assert "forward" not in vars(model)  # nothing left on the model


class ScaledLlama(transformers.LlamaForCausalLM):
    """A transform between the backbone and the logits that no config names, and that its loss sees."""

    def forward(self, *args, labels=None, num_items_in_batch=None, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2.0
        if labels is not None:
            out.loss = self.loss_function(out.logits, labels, self.config.vocab_size,
                                          num_items_in_batch=num_items_in_batch)
        return out


def test_the_probe_keeps_a_model_whose_logits_it_cannot_explain():
    model = ScaledLlama(models._llama_config())
    route = fix._probe(model, batch())
    assert not route.ok and "its own loss on this batch" in route.why, route.why


@pytest.mark.parametrize("kind, why", [("moe", "router auxiliary loss"), ("seq-cls-llama", "no backbone")])
def test_the_probe_names_what_it_cannot_route(kind, why):
    route = fix._probe(models.build_model(kind), batch(kind))
    assert not route.ok and why in route.why, route.why


def test_a_loss_function_that_is_not_the_token_mean_keeps_the_models_loss():
    model = models.build_model("causal-lm")
    model.loss_function = lambda logits, labels, vocab_size, **kw: logits.float().pow(2).mean()
    route = fix._probe(model, batch())
    assert not route.ok and "its own loss on this batch" in route.why, route.why


def test_evaluation_a_batch_without_labels_and_generation_are_left_alone():
    model = models.build_model("causal-lm")
    trainer = trainer_for(model)
    seen = []

    def original(m, inputs, *a, **k):
        seen.append("forward" in vars(m))
        return torch.tensor(0.0)

    model.eval()
    fix.compute_loss(original, trainer, (model, dict(batch())), {})
    model.train()
    fix.compute_loss(original, trainer, (model, {k: v for k, v in batch().items() if k != "labels"}), {})
    assert seen == [False, False]
    ids = batch()["input_ids"][:1, :4]
    assert model.generate(ids, max_new_tokens=2, do_sample=False).shape == (1, 6)


def test_a_forward_another_library_set_is_put_back():
    """accelerate's mixed-precision wrapper is an instance forward: the switch runs under its autocast for the call
    and restores it afterwards."""
    model = models.build_model("causal-lm")
    trainer = trainer_for(model)
    wrapper = model.forward  # a bound method stands in for accelerate's wrapper
    model.forward = wrapper
    calls = []

    def original(m, inputs, *a, **k):
        calls.append(getattr(vars(m)["forward"], "_zerofix_chunked", False))
        return m(**inputs).loss

    model.train()
    fix.compute_loss(original, trainer, (model, dict(batch())), {})
    assert calls == [True] and vars(model)["forward"] is wrapper


# Issue 52: the switch routes only what it proved equal to the model's own loss on the user's batch. Each case: the
# loss and every gradient with the switch equal the model's own (routed, or standing aside), and what it did is said.

def _bart(kind):
    config = transformers.BartConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,
                                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                     decoder_ffn_dim=32, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                                     eos_token_id=2, decoder_start_token_id=2, dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    return getattr(transformers, kind)(config)


class ZLossLlama(transformers.LlamaForCausalLM):
    """A user's subclass whose forward adds a z-loss to the model's own loss."""

    def forward(self, *args, labels=None, **kwargs):
        out = super().forward(*args, labels=labels, **kwargs)
        if out.loss is not None:
            out.loss = out.loss + 1e-2 * torch.logsumexp(out.logits.float(), dim=-1).pow(2).mean()
        return out


def seq2seq_batch(target_len):
    b = batch()
    return {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"],
            "labels": b["labels"][:, :target_len].clone()}


@pytest.mark.parametrize("case", ["bart-same-length", "bart-shorter-target", "bart-causal-lm", "z-loss-subclass"])
def test_a_model_whose_loss_the_route_does_not_reproduce_keeps_its_own(case):
    if case.startswith("bart") and "causal" not in case:
        model = _bart("BartForConditionalGeneration")
        inputs = seq2seq_batch(batch()["input_ids"].shape[1] - (0 if case == "bart-same-length" else 3))
    elif case == "bart-causal-lm":
        model, inputs = _bart("BartForCausalLM"), {k: v for k, v in batch().items() if k != "attention_mask"}
    else:
        model, inputs = ZLossLlama(models._llama_config()), batch()
    trainer = trainer_for(model)
    own, own_grads = loss_and_grads(trainer, model, inputs, routed=False)
    fix.reset_runtime()
    fix._routes.pop(model, None)
    switched, grads = loss_and_grads(trainer, model, inputs, routed=True)
    assert torch.equal(switched, own), (switched, own)  # standing aside: the model's own loss, bitwise
    for name, grad in own_grads.items():
        assert torch.equal(grads[name], grad), name
    details = fix.runtime_details()
    assert len(details) == 1 and not details[0]["routed"] and details[0]["steps"] == 0, details
    print(case, details[0]["why"])


def test_a_batch_encoding_is_routed_as_a_dict_is():
    """transformers' collators return a BatchEncoding (a Mapping, not a dict)."""
    model = models.build_model("causal-lm")
    trainer = trainer_for(model)
    inputs = transformers.BatchEncoding(batch())
    own, own_grads = loss_and_grads(trainer, model, dict(inputs), routed=False)
    fix.reset_runtime()
    fix._routes.pop(model, None)
    model.zero_grad()
    original = lambda *a, **k: transformers.Trainer.compute_loss(trainer, *a, **k)  # noqa: E731
    routed = fix.compute_loss(original, trainer, (model, inputs), {})
    routed.backward()
    assert fix.runtime_details()[0]["routed"] and fix.runtime_details()[0]["steps"] == 1
    assert torch.allclose(routed, own, rtol=1e-6)


@pytest.mark.parametrize("aside", ["return-outputs", "head-hook", "label-smoothing", "output-hidden-states"])
def test_what_asks_for_the_full_logits_stands_aside_and_is_said_once(aside, caplog):
    import logging

    model = models.build_model("causal-lm")
    trainer = trainer_for(model)
    inputs, kwargs, fired = batch(), {}, []
    if aside == "return-outputs":
        kwargs = {"return_outputs": True}
    elif aside == "head-hook":
        model.get_output_embeddings().register_forward_hook(lambda *a: fired.append(1))
    elif aside == "label-smoothing":
        trainer.label_smoother = transformers.trainer_pt_utils.LabelSmoother(0.1)
    else:
        inputs = {**inputs, "output_hidden_states": True}
    fix.reset_runtime()
    model.train()
    original = lambda *a, **k: transformers.Trainer.compute_loss(trainer, *a, **k)  # noqa: E731
    with caplog.at_level(logging.WARNING, logger="zerofix"):
        for _ in range(2):
            out = fix.compute_loss(original, trainer, (model, dict(inputs)), dict(kwargs))
    if aside == "return-outputs":
        assert out[1].logits is not None  # the caller's logits, no crash
    if aside == "head-hook":
        assert fired == [1, 1]  # once per call, as without the switch
    assert len([r for r in caplog.records if "stands aside" in r.getMessage()]) == 1, caplog.text
    assert all(not d["routed"] for d in fix.runtime_details()), fix.runtime_details()


def test_the_proof_runs_on_a_window_of_a_long_sequence_with_counted_labels():
    """The proof holds one window's logits, not a long sequence's (the memory the switch saves), and the window holds
    counted labels (a prompt masked with -100 proves nothing)."""
    ids = torch.randint(3, 60, (2, 1000))
    labels = ids.clone()
    labels[:, :900] = -100
    labels[1, 950:] = -100  # the second row counts fewer tokens
    window = fix._first_sample({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    assert window["input_ids"].shape == (1, fix.PROOF_TOKENS) and torch.equal(window["input_ids"][0], ids[0, -256:])
    assert int((window["labels"] != -100).sum()) == 100
    nothing = {"input_ids": ids[:1, :10], "labels": torch.full((1, 10), -100)}
    assert fix._probe(models.build_model("causal-lm"), nothing) is None
