"""Local stand-ins for the hub models and the dataset that transformers' Trainer gradient-accumulation tests load.

transformers' own tests of the Trainer's gradient accumulation (``TrainerGradientAccumulationTest``, the distributed
loss test) train ``nickypro/tinyllama-15M`` and ``roneneldan/TinyStories-33M`` on wikitext-2's first lines; DeepSpeed's Ulysses test
loads ``hf-internal-testing/tiny-random-LlamaForCausalLM``. Nothing
can be downloaded here, so this writes, for each of those repository ids, a tiny model of the same architecture
(Llama, GPT-Neo) with a word-level tokenizer into an offline hub cache: with ``HF_HUB_CACHE`` pointing at it and
``HF_HUB_OFFLINE=1``, ``from_pretrained("nickypro/tinyllama-15M")`` loads the stand-in unchanged. The dataset is a
text file of 40 lines laid out as wikitext's first 40 (empty lines, headings, paragraphs of every length): the
tests compare losses averaged over tokens with losses averaged over micro-batches, which differ only where samples
count different numbers of tokens with different losses.

    python tools/hub_standins.py /tmp/tf-peer/standins

Then run the tests with ``HF_HUB_CACHE=<that>/hub HF_HUB_OFFLINE=1 PEER_WIKITEXT=<that>/wikitext-train.txt``
(docs/peers.md: how the stand-in tree of transformers' tests reads that file). The tests' thresholds are
upstream's, calibrated on real models; ``STANDINS`` says how each stand-in is shaped to meet them. A random model
predicts every token about equally badly, so the per-token losses hardly vary and a loss averaged the wrong way is
hardly off: the Llama is trained on the text first.
"""
from __future__ import annotations

import argparse
import hashlib
import random
from pathlib import Path

# repository id: (architecture, steps of training on the text). The Llama stand-in is trained until paragraphs are
# easy and names stay hard (the model-loss test wants a wrongly averaged loss off by more than 0.7); the GPT-Neo one
# stays random, its loss near log(vocabulary) as a real model's on unseen text (the loss-function test wants a loss
# off by the accumulation factor to be off by more than 3).
STANDINS = {
    "nickypro/tinyllama-15M": ("llama", 400),
    "roneneldan/TinyStories-33M": ("gpt_neo", 0),
    # DeepSpeed's Ulysses test (tests/unit/ulysses_alst/test_ulysses_sp_hf.py) compares gradients, any Llama does
    "hf-internal-testing/tiny-random-LlamaForCausalLM": ("llama", 0),
}
WORDS = ("the a of and to in is was for on as with by at from that it his her their game series war city river "
         "album song band film season team player church king army ship station road school music year first "
         "second new old later early north south east west after before during while which who when where").split()
NAMES = [f"name{i}" for i in range(1000)]
ZIPF = [1.0 / (rank + 1) for rank in range(len(WORDS))]  # word frequencies as in text: a few words most of it
EOS = "</s>"
UNK = "<unk>"
N_LINES = 40


def text_lines(seed: int = 1) -> list[str]:
    """40 lines laid out as wikitext's start: empty, heading, empty, paragraph, ...

    Every other heading is made of names drawn uniformly from many (hard to predict: high per-token loss), the rest
    of common words with text-like (Zipf) frequencies, as paragraphs are: 2 to 30 words, many longer than the
    tests' 16 tokens (easy: low loss). Empty lines count no token at all. So micro-batches differ in both their
    token counts and their losses, as wikitext's do, which is what tells a token-weighted mean from a mean of
    micro-batch means.
    """
    rng = random.Random(seed)
    lines = []
    for i in range(N_LINES):
        kind = i % 4
        if kind in (0, 2):
            lines.append("")
        elif kind == 1 and i % 8 == 1:  # a heading of names: few tokens, hard
            lines.append(" = " + " ".join(rng.choice(NAMES) for _ in range(rng.randint(1, 3))) + " = ")
        elif kind == 1:  # a heading of common words: few tokens, easy
            lines.append(" = " + common_words(rng, rng.randint(1, 3)) + " = ")
        else:
            lines.append(common_words(rng, rng.randint(2, 30)))
    return lines


def common_words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(WORDS, weights=ZIPF)[0] for _ in range(n))


def tokenizer(save_dir: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {UNK: 0, EOS: 1, "=": 2}
    for word in WORDS + NAMES:
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=UNK, eos_token=EOS, bos_token=EOS)
    tok.save_pretrained(save_dir)
    return tok


def model(kind: str, vocab_size: int, eos_id: int):
    import transformers

    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
            bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=None)
        return transformers.LlamaForCausalLM(config)
    config = transformers.GPTNeoConfig(
        vocab_size=vocab_size, hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
        max_position_embeddings=64, window_size=16, bos_token_id=eos_id, eos_token_id=eos_id)
    return transformers.GPTNeoForCausalLM(config)


def pretrain(net, tok, lines: list[str], steps: int) -> None:
    """Plain training on the text, so that per-token losses differ as a pretrained model's do."""
    import torch

    torch.manual_seed(0)
    # not the headings of names: those stay unseen, hard to predict as rare words are
    ids = [tok(line)["input_ids"][:16] for line in lines if line.strip() and not set(line.split()) & set(NAMES)]
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-3)
    net.train()
    for step in range(steps):
        batch = ids[step % len(ids)]
        if len(batch) < 2:
            continue
        x = torch.tensor([batch])
        loss = net(input_ids=x, labels=x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def write(root: Path) -> Path:
    """Write the hub cache under root/hub and the text under root/wikitext-train.txt; returns root."""
    import torch

    torch.manual_seed(0)
    root.mkdir(parents=True, exist_ok=True)
    lines = text_lines()
    (root / "wikitext-train.txt").write_text("\n".join(lines) + "\n")
    for repo_id, (kind, steps) in STANDINS.items():
        commit = hashlib.sha1(repo_id.encode()).hexdigest()  # any 40-hex name: the cache only needs refs/main
        repo_dir = root / "hub" / ("models--" + repo_id.replace("/", "--"))
        snapshot = repo_dir / "snapshots" / commit
        snapshot.mkdir(parents=True, exist_ok=True)
        tok = tokenizer(snapshot)
        net = model(kind, len(tok), tok.eos_token_id)
        pretrain(net, tok, lines, steps)
        net.save_pretrained(snapshot)
        (repo_dir / "refs").mkdir(exist_ok=True)
        (repo_dir / "refs" / "main").write_text(commit)
    return root


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", type=Path, help="folder to write the stand-ins into")
    args = p.parse_args(argv)
    root = write(args.root)
    print(f"HF_HUB_CACHE={root / 'hub'} HF_HUB_OFFLINE=1 PEER_WIKITEXT={root / 'wikitext-train.txt'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
