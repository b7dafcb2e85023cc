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


# Issue 58, item 1: the proof runs what training runs. Each model below differs from the route only in training; the
# switch keeps its own loss (bitwise, with the same random state as without the switch) and says why, or stands aside.

class TrainingZLossLlama(transformers.LlamaForCausalLM):
    """A z-loss added only in training (evaluation reports the plain cross-entropy)."""

    def forward(self, *args, labels=None, **kwargs):
        out = super().forward(*args, labels=labels, **kwargs)
        if out.loss is not None and self.training:
            out.loss = out.loss + 1e-2 * torch.logsumexp(out.logits.float(), dim=-1).pow(2).mean()
        return out


class HeadDropoutLlama(transformers.LlamaForCausalLM):
    """Dropout on the last hidden state before the head, as some fine-tuning recipes add."""

    def __init__(self, config):
        super().__init__(config)
        self.head_dropout = torch.nn.Dropout(0.1)

    def forward(self, input_ids=None, attention_mask=None, labels=None, num_items_in_batch=None, **kwargs):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
        logits = self.lm_head(self.head_dropout(hidden))
        loss = None if labels is None else self.loss_function(logits, labels, self.config.vocab_size,
                                                              num_items_in_batch=num_items_in_batch)
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


def seeded_loss_and_grads(trainer, model, inputs, routed: bool):
    torch.manual_seed(1234)  # the same random state with and without the switch: the same dropout masks
    if torch.cuda.is_available() and next(model.parameters()).is_cuda:
        torch.cuda.manual_seed_all(1234)
    return loss_and_grads(trainer, model, inputs, routed)


def with_and_without_the_switch(model, inputs, device="cpu"):
    """The model's own training loss and gradients, then the switch's, from the same random state (on ``device``):
    (own loss, own gradients, switched loss, switched gradients, what the switch said)."""
    trainer = trainer_for(model)
    model.to(device)  # (after the Trainer, which puts a use_cpu model on the CPU)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    own, own_grads = seeded_loss_and_grads(trainer, model, inputs, routed=False)
    fix.reset_runtime()
    fix._routes.pop(model, None)
    switched, grads = seeded_loss_and_grads(trainer, model, inputs, routed=True)
    return own, own_grads, switched, grads, fix.runtime_details()


def training_only_model(kind):
    return kind(models._llama_config())


def dropping_out_backbone():
    config = models._llama_config()
    config.attention_dropout = 0.2
    model = transformers.LlamaForCausalLM(config)
    model.config._attn_implementation = "eager"  # sdpa's dropout draws its masks elsewhere: eager shows the draw
    return model


TRAINING_ONLY = [(TrainingZLossLlama, "an extra term such as a z-loss"), (HeadDropoutLlama, "differs from the route")]


@pytest.mark.parametrize("kind, why", TRAINING_ONLY)
def test_what_only_training_runs_keeps_the_models_own_loss(kind, why):
    model = training_only_model(kind)
    own, own_grads, switched, grads, details = with_and_without_the_switch(model, batch())
    assert torch.equal(switched, own), (switched, own)  # its own loss, bitwise: the proof left the random state as is
    for name, grad in own_grads.items():
        assert torch.equal(grads[name], grad), name
    assert len(details) == 1 and not details[0]["routed"] and why in details[0]["why"], details
    model.eval()  # (what the proof ran before issue 58: in evaluation, nothing tells the route from the model's own)
    with torch.no_grad():
        inputs = batch()
        assert fix._probe(model, {"input_ids": inputs["input_ids"], "labels": inputs["labels"]}).ok


def test_a_model_whose_backbone_drops_out_is_routed_with_the_steps_own_masks():
    """Dropout inside the backbone (attention dropout): both forwards of the proof draw the same masks, so the route is
    proven; the routed step draws the masks the model's own step would have drawn (the proof restored the state)."""
    own, own_grads, routed, grads, details = with_and_without_the_switch(dropping_out_backbone(), batch())
    assert details[0]["routed"], details
    assert torch.allclose(routed, own, rtol=1e-6), (routed, own)
    for name, grad in own_grads.items():
        assert torch.allclose(grads[name], grad, rtol=1e-4, atol=1e-7), name


def test_a_hook_on_the_model_that_reads_its_logits_makes_the_switch_stand_aside(caplog):
    import logging

    model = models.build_model("causal-lm")
    trainer = trainer_for(model)
    read = []
    model.register_forward_hook(lambda module, args, out: read.append(out.logits.detach().shape))
    fix.reset_runtime()
    model.train()
    original = lambda *a, **k: transformers.Trainer.compute_loss(trainer, *a, **k)  # noqa: E731
    with caplog.at_level(logging.WARNING, logger="zerofix"):
        for _ in range(2):
            fix.compute_loss(original, trainer, (model, dict(batch())), {})
    assert len(read) == 2 and all(shape[-1] == model.config.vocab_size for shape in read)  # the logits, no crash
    assert len([r for r in caplog.records if "stands aside" in r.getMessage()]) == 1, caplog.text
    assert "forward hooks on LlamaForCausalLM" in caplog.text


# Issue 69, item 1: the proof replays all of the step's randomness (torch's, Python's and NumPy's) and keeps out of the
# user's hooks' way: a model drawing from Python's random or NumPy trains as without the switch; a process-wide hook and a
# backward hook on the head make it stand aside; a hook inside the backbone sees only the step's forwards.

class LayerDropLlama(transformers.LlamaForCausalLM):
    """Stochastic depth written by hand: in training each decoder layer is skipped with probability 1/2, drawn from
    ``DRAW`` (Python's ``random``, NumPy's global generator, or the operating system's, which nothing can replay)."""

    DRAW = None

    def __init__(self, config):
        super().__init__(config)
        draw = type(self).DRAW
        for i, layer in enumerate(self.model.layers):
            self.model.layers[i] = _Skippable(layer, draw)


class _Skippable(torch.nn.Module):
    def __init__(self, layer, draw):
        super().__init__()
        self.layer, self.draw = layer, draw

    def forward(self, hidden_states, *args, **kwargs):
        if self.training and self.draw() < 0.5:
            return hidden_states
        return self.layer(hidden_states, *args, **kwargs)


def layer_drop(draw):
    import random

    import numpy

    kind = type("Drop", (LayerDropLlama,), {"DRAW": staticmethod({"python": random.random,
                                                                  "numpy": numpy.random.random,
                                                                  "system": random.SystemRandom().random}[draw])})
    config = models._llama_config()
    # the operating system's draws: 24 layers, so two forwards skip the same layers with probability 2**-24 (with 4,
    # 1/16 of runs drew alike twice and the proof read another difference first: a flaky test)
    config.num_hidden_layers = 24 if draw == "system" else 4
    return kind(config)


def seeded_everywhere(trainer, model, inputs, routed: bool):
    import random

    import numpy

    random.seed(99)
    numpy.random.seed(99)
    return seeded_loss_and_grads(trainer, model, inputs, routed)


@pytest.mark.parametrize("draw", ["python", "numpy"])
def test_a_model_drawing_from_pythons_or_numpys_random_trains_as_without_the_switch(draw):
    model = layer_drop(draw)
    trainer = trainer_for(model)
    inputs = batch()
    own, own_grads = seeded_everywhere(trainer, model, inputs, routed=False)
    fix.reset_runtime()
    fix._routes.pop(model, None)
    routed, grads = seeded_everywhere(trainer, model, inputs, routed=True)
    details = fix.runtime_details()
    assert details[0]["routed"], details  # the proof's two forwards drew the same layers: proven
    assert torch.allclose(routed, own, rtol=1e-6, atol=0), (routed, own)  # the step drew what it draws without it
    for name, grad in own_grads.items():
        assert torch.allclose(grads[name], grad, rtol=1e-5, atol=1e-7), name


def test_a_model_drawing_from_elsewhere_keeps_its_own_loss_and_says_why():
    model = layer_drop("system")
    trainer = trainer_for(model)
    fix.reset_runtime()
    seeded_everywhere(trainer, model, batch(), routed=True)
    details = fix.runtime_details()
    assert not details[0]["routed"] and "does not repeat itself from one random state" in details[0]["why"], details


def routed_call(trainer, model, inputs):
    model.train()
    original = lambda *a, **k: transformers.Trainer.compute_loss(trainer, *a, **k)  # noqa: E731
    return fix.compute_loss(original, trainer, (model, dict(inputs)), {})


def test_a_process_wide_hook_makes_the_switch_stand_aside_without_a_crash(caplog):
    import logging

    from torch.nn.modules.module import register_module_forward_hook

    model = models.build_model("causal-lm")
    trainer = trainer_for(model)
    read = []
    handle = register_module_forward_hook(
        lambda module, args, out: read.append(out.logits.shape) if hasattr(out, "logits") else None)
    try:
        fix.reset_runtime()
        with caplog.at_level(logging.WARNING, logger="zerofix"):
            for _ in range(2):
                routed_call(trainer, model, batch()).backward()
    finally:
        handle.remove()
    assert len(read) == 2 and all(shape[-1] == model.config.vocab_size for shape in read)  # what it reads without it
    said = [r.getMessage() for r in caplog.records if "stands aside" in r.getMessage()]
    assert len(said) == 1 and "process-wide module hooks" in said[0], caplog.text


def test_a_backward_hook_on_the_head_fires_as_often_as_without_the_switch(caplog):
    import logging

    fired = {}
    for switched in (False, True):
        model = models.build_model("causal-lm")
        trainer = trainer_for(model)
        calls = fired[switched] = []
        model.lm_head.register_full_backward_hook(lambda module, gin, gout: calls.append(gout[0].shape))
        fix.reset_runtime()
        with caplog.at_level(logging.WARNING, logger="zerofix"):
            for _ in range(3):
                loss = routed_call(trainer, model, batch()) if switched else \
                    transformers.Trainer.compute_loss(trainer, model.train(), dict(batch()))
                loss.backward()
    assert len(fired[True]) == len(fired[False]) == 3, fired
    assert "hooks on the output head" in caplog.text


def test_a_hook_inside_the_backbone_sees_only_the_steps_forwards():
    calls = {}
    for switched in (False, True):
        model = models.build_model("causal-lm")
        trainer = trainer_for(model)
        seen = calls[switched] = []
        model.model.norm.register_forward_hook(lambda module, args, out: seen.append(out.shape))
        fix.reset_runtime()
        fix._routes.pop(model, None)
        for _ in range(4):
            loss = routed_call(trainer, model, batch()) if switched else \
                transformers.Trainer.compute_loss(trainer, model.train(), dict(batch()))
            loss.backward()
        if switched:
            assert fix.runtime_details()[0]["routed"], fix.runtime_details()  # the route ran the backbone 4 times
    assert len(calls[True]) == len(calls[False]) == 4, {k: len(v) for k, v in calls.items()}


def test_a_model_that_runs_its_decoder_directly_is_proven_from_its_heads_input():
    """OPT's forward calls ``model.decoder`` itself, so the backbone's own forward (``model``) never runs there: the proof
    reads the head's input instead (issue 69: it was kept with "runs its backbone on other inputs")."""
    config = transformers.OPTConfig(vocab_size=models.VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                                    num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32,
                                    dropout=0.0, attention_dropout=0.0, layerdrop=0.0, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.OPTForCausalLM(config)
    own, own_grads, routed, grads, details = with_and_without_the_switch(model, batch())
    assert details[0]["routed"], details
    assert torch.allclose(routed, own, rtol=1e-6), (routed, own)
