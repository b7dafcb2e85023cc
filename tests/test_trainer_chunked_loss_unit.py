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
    """A transform between the backbone and the logits that no config names."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if out.logits is not None:
            out.logits = out.logits * 2.0
        return out


def test_the_probe_keeps_a_model_whose_logits_it_cannot_explain():
    model = ScaledLlama(models._llama_config())
    route = fix._probe(model, batch())
    assert not route.ok and "not its head applied" in route.why


@pytest.mark.parametrize("kind, why", [("moe", "router auxiliary loss"), ("seq-cls-llama", "no backbone")])
def test_the_probe_names_what_it_cannot_route(kind, why):
    route = fix._probe(models.build_model(kind), batch(kind))
    assert not route.ok and why in route.why, route.why


def test_a_loss_function_that_is_not_the_token_mean_keeps_the_models_loss():
    model = models.build_model("causal-lm")
    model.loss_function = lambda logits, labels, vocab_size, **kw: logits.float().pow(2).mean()
    route = fix._probe(model, batch())
    assert not route.ok and "loss_function" in route.why


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
