"""Peak memory and time of a Trainer window for the heads that compute their own token mean (issue 59), upstream
against ``zerofix.patch()``.

    python benchmarks/bench_own_mean_heads.py                   # seq 1024, vocabulary 32000, GAS 2 x batch 2
    python benchmarks/bench_own_mean_heads.py --device cuda --seq 4096 --vocab 128000   # bf16 on a GPU

Two heads, both tiny random Llamas (hidden 256, 2 layers: the logits dominate, as in a real VLM's language model) that
say ``accepts_loss_kwargs = False`` as Qwen3-VL, GLM-4V, Qwen3.5 and Gemma 3 do on transformers 4.57 - 5.6:

- ``loss-function``: the forward takes the count and calls its loss function without it (Qwen3-VL's pattern); zerofix
  hands the count on to the loss function (``trainer_scaling.CountToLoss``);
- ``inline``: the forward computes its own token mean inline (Gemma 3's pattern); zerofix proves it from the logits the
  head returns, without autograd, in chunks, and weighs it (``zerofix.own_mean``).

Each variant runs in a fresh process, ``--repeats`` times, interleaved; medians reported. Peak memory is the growth of
the process's peak RSS during ``trainer.train()`` (CPU) or the CUDA allocator's peak over what was allocated before
(GPU). The updates are compared after the measurement: upstream's is a mean of micro-batch means, zerofix's the
window's token mean, so they differ by design; the ratio printed is zerofix's update against upstream's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from bench_trainer_chunked_loss import timed_train  # the same measure of a Trainer step's time and peak

HEADS = ("loss-function", "inline")


def head_class(head: str):
    import torch.nn.functional as F
    import transformers

    class NoCount(transformers.LlamaForCausalLM):
        accepts_loss_kwargs = False

    class LossFunctionHead(NoCount):
        def forward(self, *args, num_items_in_batch=None, **kwargs):
            return super().forward(*args, **kwargs)  # the count is not passed on (Qwen3-VL on 4.57 - 5.6)

    class InlineHead(NoCount):
        def forward(self, *args, labels=None, num_items_in_batch=None, **kwargs):
            out = super().forward(*args, **kwargs)
            if labels is not None:  # Gemma 3's: the float logits, shifted, an inline mean
                logits = out.logits.float()
                out["logits"] = logits
                out["loss"] = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
            return out

    return {"loss-function": LossFunctionHead, "inline": InlineHead}[head]


def child(head: str, variant: str, seq: int, vocab: int, device: str) -> dict:
    import torch
    import transformers

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    if variant == "zerofix":
        import zerofix

        zerofix.patch()
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
                                      tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = head_class(head)(config)
    g = torch.Generator().manual_seed(1)
    data = []
    for i in range(4):  # uneven counts: a prompt of a different length in each sample
        ids = torch.randint(0, vocab, (seq,), generator=g)
        labels = ids.clone()
        labels[: seq // 8 * (i + 1)] = -100
        data.append({"input_ids": ids, "labels": labels})
    cuda = device == "cuda"
    args = transformers.TrainingArguments(output_dir=tempfile.mkdtemp(), use_cpu=not cuda, bf16=cuda,
                                          report_to="none", per_device_train_batch_size=2,
                                          gradient_accumulation_steps=2, max_steps=1, optim="sgd", learning_rate=1.0,
                                          lr_scheduler_type="constant", save_strategy="no", logging_strategy="no",
                                          disable_tqdm=True, max_grad_norm=0, remove_unused_columns=False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    seconds, peak = timed_train(trainer, model, cuda)
    update = torch.cat([(p.detach().cpu() - before[n].cpu()).flatten() for n, p in model.named_parameters()])
    details = {}
    if variant == "zerofix":
        from zerofix.fixes import trainer_scaling

        details = (trainer_scaling.runtime_details() or [{}])[-1]
    return {"seconds": seconds, "peak_mib": peak, "update": update.tolist()[:: max(1, len(update) // 20000)],
            "route": ("inline mean proven, weighed" if "own_mean" in details else
                      "count handed on" if details.get("count_handed") else "-")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.seq, args.vocab, args.device)))
        return
    runs = {(h, v): [] for h in HEADS for v in ("upstream", "zerofix")}
    for _ in range(args.repeats):  # interleaved
        for head, variant in runs:
            cmd = [sys.executable, __file__, "--child", head, variant, "--seq", str(args.seq), "--vocab",
                   str(args.vocab), "--device", args.device]
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
            if proc.returncode != 0:
                sys.exit(f"{head} {variant} failed:\n{proc.stderr[-3000:]}")
            runs[head, variant].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    import torch

    where = f"CUDA ({torch.cuda.get_device_name()}), bf16" if args.device == "cuda" else \
        f"CPU, {os.environ.get('OMP_NUM_THREADS', 2)} threads"
    print(f"1 Trainer step, GAS 2 x batch 2 x {args.seq} tokens, vocabulary {args.vocab}, tiny Llama heads (hidden 256, "
          f"2 layers), {where}; median of {args.repeats} processes")
    print(f"{'head':<14} {'upstream MiB':>12} {'zerofix MiB':>12} {'x':>6} {'upstream s':>10} {'zerofix s':>10} {'x':>6}"
          f"  update ratio  route")
    out = {}
    for head in HEADS:
        med = {v: {m: statistics.median(r[m] for r in runs[head, v]) for m in ("seconds", "peak_mib")}
               for v in ("upstream", "zerofix")}
        up, zf = (torch.tensor(runs[head, v][0]["update"]) for v in ("upstream", "zerofix"))
        ratio = float((zf @ up) / (up @ up))
        out[head] = {"medians": med, "update_ratio": ratio, "route": runs[head, "zerofix"][0]["route"]}
        print(f"{head:<14} {med['upstream']['peak_mib']:>12.0f} {med['zerofix']['peak_mib']:>12.0f} "
              f"{med['zerofix']['peak_mib'] / med['upstream']['peak_mib']:>6.3f} {med['upstream']['seconds']:>10.2f} "
              f"{med['zerofix']['seconds']:>10.2f} {med['zerofix']['seconds'] / med['upstream']['seconds']:>6.3f}"
              f"  {ratio:>12.4f}  {out[head]['route']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seq": args.seq, "vocab": args.vocab, "device": args.device, "heads": out}, f, indent=1)


if __name__ == "__main__":
    main()
