"""What zerofix costs, measured side by side in one run.

1. Interpreter start-up (``python -c pass``) with and without ``ZEROFIX=1`` (the .pth activation; no
   ML library is imported), runs interleaved, median of N.
2. ``import zerofix`` in a fresh interpreter, median of N.
3. Per call: a raw method vs the same method wrapped through zerofix's patching (pass-through wrapper),
   and the real ``transformers-trainer-scaling`` wrappers around a no-op training step with a
   real ``accelerate.Accelerator(gradient_accumulation_steps=8)`` (when accelerate is installed), and
   accelerate-short-last-window's two wrappers on one micro-batch of a plain loop.

Targets (issue 2): < 20 ms added at start-up, < 10 us per wrapped call.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import timeit

N = int(os.environ.get("BENCH_N", "21"))


def _child_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROFIX")}
    env.update(extra)
    return env


def startup_ms():
    times = {"off": [], "on": []}
    for _ in range(N):
        for label, env in (("off", _child_env()), ("on", _child_env(ZEROFIX="1"))):
            t0 = timeit.default_timer()
            subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
            times[label].append((timeit.default_timer() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def import_ms():
    code = "import time; t=time.perf_counter(); import zerofix; print((time.perf_counter()-t)*1e3)"
    vals = [float(subprocess.run([sys.executable, "-c", code], env=_child_env(), check=True,
                                 capture_output=True, text=True).stdout) for _ in range(N)]
    return statistics.median(vals)


def per_call_us():
    import types

    from zerofix import applied, catalogue, patching
    from zerofix.fixes import contract
    from zerofix.catalogue import Fix, Target

    class Engine:
        def step(self, x):
            return x

    raw_engine = Engine()
    raw = min(timeit.repeat(lambda: raw_engine.step(1), number=100_000, repeat=5)) / 100_000 * 1e6

    impl = types.ModuleType("bench_passthrough")
    impl.FIX_IDS = ("bench",)
    impl.structural_check = lambda fix_id, targets: contract.found()
    impl.step = lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs)
    sys.modules["bench_passthrough"] = impl
    mod = types.ModuleType("bench_target")
    mod.Engine = Engine
    sys.modules["bench_target"] = mod
    saved = catalogue.FIXES
    catalogue.FIXES = (Fix("bench", "bench", "pip", ">=0", (Target("bench_target", "Engine.step", "bench_passthrough:step"),),
                           "bench_passthrough"),)
    try:
        patching.patch()
        assert applied.is_applied("bench")
        wrapped = min(timeit.repeat(lambda: raw_engine.step(1), number=100_000, repeat=5)) / 100_000 * 1e6
        patching.unpatch()
    finally:
        catalogue.FIXES = saved
    out = {"raw method": raw, "zerofix-wrapped (pass-through)": wrapped}

    try:
        import torch
        from accelerate import Accelerator

        from zerofix.fixes import trainer_scaling as fix
    except Exception as exc:  # noqa: BLE001
        print(f"(real wrapper not measured: {exc})")
        return out
    # The Trainer's scaling mechanism: training_step opens the step, Accelerator.backward plans and acts. The
    # trainer's verdict is known after its first step, so a steady-state step reads the facts and plans only.
    accelerator = Accelerator(gradient_accumulation_steps=8, cpu=True)

    class Trainer:  # what the wrappers read of a transformers Trainer (weak-referenceable, as a real one is)
        model_accepts_loss_kwargs, compute_loss_func, loss_is_scaled_for_ga = True, None, None
        model = torch.nn.Linear(2, 2)
        args = types.SimpleNamespace(gradient_accumulation_steps=8, average_tokens_across_devices=True)

        def __init__(self):
            self.accelerator = accelerator
            self.state = types.SimpleNamespace()  # one train() run: what the entry reads once a run stays read

    trainer = Trainer()
    noop = lambda *a, **k: None  # noqa: E731
    step = lambda model, inputs, n: fix.backward(noop, accelerator, (1.0,), {})  # noqa: E731
    bare = min(timeit.repeat(lambda: step(None, None, 5), number=20_000, repeat=5)) / 20_000 * 1e6
    count = torch.tensor(512)
    fix.training_step(step, trainer, (None, None, count), {})  # the first step: the verdict
    real = min(timeit.repeat(lambda: fix.training_step(step, trainer, (None, None, count), {}),
                             number=20_000, repeat=5)) / 20_000 * 1e6
    out["Trainer step: training_step + Accelerator.backward wrappers (real Accelerator, GAS=8)"] = real
    out["Accelerator.backward wrapper outside a Trainer step"] = bare
    out.update(short_window_us(accelerator, noop, raw))
    return out


def watch_us() -> dict:
    """transformers-trainer-scaling's watch, paid at every Trainer step: a loss divided by a watched
    num_items_in_batch (followed through the .to() and the division, its verdict decided, the step closed and the loss
    handed on plain) against the same
    division by the plain tensor (transformers' normalised cross-entropy), on a micro-batch of 512 tokens over a
    32,000-word vocabulary. The watch costs the few operations on the count, whatever the model's size."""
    import torch
    import torch.nn.functional as F

    from zerofix import num_items_watch

    logits, labels, count = torch.randn(512, 32_000), torch.randint(0, 32_000, (512,)), torch.tensor(2048)

    def loss(n):
        return F.cross_entropy(logits, labels, reduction="sum") / n.to(logits.device)

    plain = min(timeit.repeat(lambda: loss(count), number=20, repeat=5)) / 20 * 1e6
    def followed():
        try:
            out = loss(num_items_watch.watch(count))
            assert num_items_watch.decide(out).state == num_items_watch.DIVIDED
            return num_items_watch.unwatched(out)
        finally:
            num_items_watch.close()

    watched = min(timeit.repeat(followed, number=20, repeat=5)) / 20 * 1e6
    return {"a normalised loss (512 x 32k cross-entropy), plain count": plain,
            "the same loss, watched and followed count (every Trainer step)": watched}


def means_reading_us() -> dict:
    """transformers-trainer-scaling's micro-batch-mean reading (issue 59: read window after window while their counts
    are equal, up to 64 windows): one walk of a loss's autograd graph a micro-batch, against that micro-batch's
    forward+backward, on a tiny Llama (hidden 64, 2 layers, 2 x 256 tokens: the least a step costs, so the largest
    share the walk can take)."""
    import torch
    import transformers

    from zerofix.check import models
    from zerofix.micro_means import micro_means

    model = transformers.LlamaForCausalLM(models._llama_config())
    ids = torch.randint(0, model.config.vocab_size, (2, 256))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()

    step_us = min(timeit.repeat(step, number=3, repeat=3)) / 3 * 1e6
    loss = model(input_ids=ids, labels=ids).loss
    walk_us = min(timeit.repeat(lambda: micro_means(loss), number=20, repeat=5)) / 20 * 1e6
    return {"a tiny Llama's micro-batch (2 x 256 tokens), forward+backward": step_us,
            "the micro-batch-mean reading's graph walk of its loss": walk_us}


def short_window_us(accelerator, noop, raw: float) -> dict:
    """accelerate-short-last-window, one micro-batch of a plain loop: the accumulate() wrapper (counts it) and
    the backward wrapper, mid-window (sync_gradients False) and at a full window's end (True, not the end
    of the dataloader): the common cases; a short window's rescale is the gradient multiply itself."""
    from zerofix.fixes import accelerate_short_window as short

    def micro(sync: bool):
        short.accumulate(noop, accelerator, (), {})
        accelerator.gradient_state._set_sync_gradients(sync)
        short.backward(noop, accelerator, (1.0,), {})

    def bare(sync: bool):
        noop()
        accelerator.gradient_state._set_sync_gradients(sync)
        noop(1.0)

    out = {}
    for label, sync in (("mid-window", False), ("closing a full window", True)):
        patched = min(timeit.repeat(lambda: micro(sync), number=20_000, repeat=5)) / 20_000 * 1e6
        plain = min(timeit.repeat(lambda: bare(sync), number=20_000, repeat=5)) / 20_000 * 1e6
        # reported like the other rows: the raw method's cost plus what the two wrappers add
        out[f"accumulate() + backward wrappers, {label}"] = raw + (patched - plain)
    accelerator.__dict__.pop(short._KEY, None)
    return out


def main():
    print(f"zerofix overhead, {sys.executable}, median of {N}")
    s = startup_ms()
    print(f"\nstart-up  python -c pass        {s['off']:7.1f} ms")
    print(f"start-up  ZEROFIX=1 python -c pass {s['on']:7.1f} ms   added {s['on'] - s['off']:+.1f} ms (target < 20)")
    print(f"import zerofix                     {import_ms():7.2f} ms")
    calls = per_call_us()
    base = calls["raw method"]
    print()
    try:
        watch = watch_us()
    except ImportError as exc:
        watch = {}
        print(f"(the watch not measured: {exc})")
    for name, us in watch.items():  # once per trainer: not a per-call overhead, compared with each other
        print(f"first step {name:66s} {us / 1000:8.2f} ms")
    try:
        reading = means_reading_us()
    except ImportError as exc:
        reading = {}
        print(f"(the micro-batch-mean reading not measured: {exc})")
    for name, us in reading.items():  # per micro-batch while the reading lasts, compared with each other
        print(f"reading    {name:66s} {us / 1000:8.2f} ms")
    for name, us in calls.items():
        extra = "" if name == "raw method" else f"   added {us - base:+.2f} us (target < 10)"
        print(f"per call  {name:<48} {us:6.2f} us{extra}")


if __name__ == "__main__":
    main()
