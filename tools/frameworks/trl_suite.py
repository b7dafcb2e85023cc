"""TRL's own preference trainers as the frameworks pin them (issue 53, item 2): DPO, ORPO, CPO, KTO and reward
modelling of the installed TRL (0.29.1 on the swift stack), with and without ``zerofix.patch()``.

    .venvs/swift/bin/python tools/frameworks/trl_suite.py OUT_DIR [ROW ...]

Each row: one SGD step on the tiny local Llama of ``tiny_model.py`` (fp32, set explicitly: TRL's configs default to
bf16, one process), GA 4 x 2 unpatched and
patched against the big batch 1 x 8 unpatched (the same 8 pairs in order). Each run in a fresh process. Prints a
Markdown table (update ratio / cosine; right when max |A - R| / max |R| < 1e-4) and writes OUT_DIR/results.jsonl.
KTO's KL term is estimated from the batch's mismatched pairs, so its GA and big-batch runs differ by design: measured,
not judged.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from fw_measure import cell, comparison  # noqa: E402

ROWS = ("dpo", "orpo", "cpo", "kto", "reward")


def train(work: Path, row: str, gas: int, batch: int, patched: bool, out: Path) -> None:
    """One run (in its own process): the row's trainer, one optimizer step, the updated weights saved to ``out``."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    if patched:
        import zerofix

        zerofix.patch()
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(work / "model")
    rows = [json.loads(line) for line in (work / "dpo.jsonl").read_text().splitlines()]
    prompts = [[m for m in r["messages"] if m["role"] == "user"] for r in rows]
    chosen = [[m for m in r["messages"] if m["role"] == "assistant"] for r in rows]
    rejected = [[{"role": "assistant", "content": r["rejected_response"]}] for r in rows]
    common = dict(output_dir=str(out / "trainer"), per_device_train_batch_size=batch, gradient_accumulation_steps=gas,
                  max_steps=1, learning_rate=1.0, optim="sgd", lr_scheduler_type="constant", warmup_steps=0,
                  weight_decay=0.0, max_grad_norm=0.0, report_to="none", save_strategy="no", logging_steps=1,
                  use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True,
                  bf16=False, fp16=False)  # TRL's configs default to bf16=True, which autocasts on CPU too (issue 60)
    if row == "reward":
        from trl import RewardConfig, RewardTrainer

        model = AutoModelForSequenceClassification.from_pretrained(work / "model", num_labels=1)
        model.config.pad_token_id = tok.pad_token_id
        data = Dataset.from_dict({"chosen": [p + c for p, c in zip(prompts, chosen)],
                                  "rejected": [p + r for p, r in zip(prompts, rejected)]})
        trainer = RewardTrainer(model=model, args=RewardConfig(**common), train_dataset=data, processing_class=tok)
    else:
        model = AutoModelForCausalLM.from_pretrained(work / "model")
        if row == "kto":
            from trl import KTOConfig, KTOTrainer

            data = Dataset.from_dict({"prompt": prompts, "completion": [c if i % 2 == 0 else r for i, (c, r) in
                                                                         enumerate(zip(chosen, rejected))],
                                      "label": [i % 2 == 0 for i in range(len(rows))]})
            trainer = KTOTrainer(model=model, args=KTOConfig(**common), train_dataset=data, processing_class=tok)
        else:
            data = Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected})
            if row == "dpo":
                from trl import DPOConfig, DPOTrainer

                trainer = DPOTrainer(model=model, args=DPOConfig(**common), train_dataset=data, processing_class=tok)
            elif row == "orpo":
                try:
                    from trl.experimental.orpo import ORPOConfig, ORPOTrainer
                except ImportError:  # TRL < 0.26 keeps it in trl itself
                    from trl import ORPOConfig, ORPOTrainer

                trainer = ORPOTrainer(model=model, args=ORPOConfig(**common), train_dataset=data,
                                      processing_class=tok)
            else:
                try:
                    from trl.experimental.cpo import CPOConfig, CPOTrainer
                except ImportError:
                    from trl import CPOConfig, CPOTrainer

                trainer = CPOTrainer(model=model, args=CPOConfig(**common), train_dataset=data, processing_class=tok)
    from torch.utils.data import SequentialSampler

    trainer._get_train_sampler = lambda *a, **k: SequentialSampler(trainer.train_dataset)  # the same pairs in order
    trainer.train()
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / "final.pt")
    init = type(model).from_pretrained(work / "model", **({"num_labels": 1} if row == "reward" else {}))
    torch.save({k: v.detach().clone() for k, v in init.state_dict().items()}, out / "init.pt")


def compare(measured: Path, reference: Path) -> dict:
    import torch

    def update(d):
        init, end = torch.load(d / "init.pt"), torch.load(d / "final.pt")
        return torch.cat([(end[k].double() - init[k].double()).flatten() for k in sorted(init)
                          if k in end and "score" not in k])  # a reward head is new: the backbone's update

    return comparison(update(measured), update(reference))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        _, work, row, gas, batch, patched, out = argv
        train(Path(work), row, int(gas), int(batch), patched == "1", Path(out))
        return 0
    import tiny_model

    work = Path(argv[0]).resolve()
    rows = argv[1:] or list(ROWS)
    work.mkdir(parents=True, exist_ok=True)
    tiny_model.build(work)
    results = []
    for row in rows:
        outs = {}
        for variant, (gas, batch, patched) in {"big": (1, 8, 0), "plain": (4, 2, 0), "zerofix": (4, 2, 1)}.items():
            out = work / row / variant
            out.mkdir(parents=True, exist_ok=True)
            done = subprocess.run([sys.executable, __file__, "--child", str(work), row, str(gas), str(batch),
                                   str(patched), str(out)], capture_output=True, text=True)
            (out / "log.txt").write_text(done.stdout + done.stderr)
            outs[variant] = out if done.returncode == 0 else None
        entry = {"row": row, "judged": row != "kto"}
        for variant in ("plain", "zerofix"):
            entry[variant] = (compare(outs[variant], outs["big"]) if outs[variant] and outs["big"]
                              else {"error": f"see {row}/{variant}/log.txt"})
        log = (work / row / "zerofix" / "log.txt").read_text()
        entry["zerofix_lines"] = [line for line in log.splitlines() if "zerofix: " in line]
        if outs["plain"] and outs["zerofix"]:  # zerofix's update against upstream's own, bitwise
            import torch

            a, b = torch.load(outs["plain"] / "final.pt"), torch.load(outs["zerofix"] / "final.pt")
            entry["bitwise_as_unpatched"] = all(torch.equal(a[k], b[k]) for k in a)
        results.append(entry)
    (work / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    import trl

    print(f"TRL {trl.__version__}")
    print("| TRL trainer | unpatched | `zerofix.patch()` | patched bitwise as unpatched | zerofix said |\n"
          "|---|---|---|---|---|")
    for r in results:
        warned = any("averages a term over its own micro-batch" in line for line in r["zerofix_lines"])
        print(f"| {r['row']} | {cell(r['plain'], r['judged'])} | {cell(r['zerofix'], r['judged'])} "
              f"| {r.get('bitwise_as_unpatched', '-')} | {'WARNING: a micro-batch mean term' if warned else '-'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
