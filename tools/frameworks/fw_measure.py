"""What the framework suites share: an update compared with the reference's, its table cell, and the runner that drives
a framework's own command line (big batch, accumulated unpatched, accumulated with ``ZEROFIX=1``) and writes the
measured table into docs/frameworks.md between the framework's markers.

A framework is described by a :class:`Framework` (its rows, layouts, how one run's command line is built); the suites
(``swift_suite.py``, ``llamafactory_suite.py``) are that description plus their own command line.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import glob
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
DOCS = HERE.parent.parent / "docs" / "frameworks.md"
RIGHT = 1e-4  # max |A - R| / max |R| below which an update is the reference's
LAYOUTS = ("ddp", "zero2", "zero3")  # two processes; the default layout is one process


def comparison(a, r) -> dict:
    """``a`` (an update, a flat float64 tensor) against the reference update ``r``."""
    return {"ratio": float(a @ r / (r @ r)), "cosine": float(a @ r / a.norm() / r.norm()),
            "rel": float((a - r).abs().max() / r.abs().max())}


def cell(result: dict, judged: bool) -> str:
    """``ratio / cosine`` and, for a judged row, right or wrong."""
    if "error" in result:
        return "error"
    verdict = "" if not judged else " right" if result["rel"] < RIGHT else " wrong"
    return f"{result['ratio']:.4f} / {result['cosine']:.4f}{verdict}"


@dataclass
class Framework:
    """One framework's suite, ``tools/frameworks/<name>_suite.py``. ``command(work, row, out, gas, batch, layout,
    sixteen)`` is one run's command line (``layout`` None for one process; ``sixteen``: the 16-sample data of the
    2-process rows); ``two_process_env()`` the variables one accumulated run on two processes needs besides
    ``ZEROFIX``; ``weights`` the glob, under a run's output folder, of the one-step checkpoint's weights;
    ``prepare(work)`` writes what the framework reads beside ``tiny_model``'s files."""
    name: str
    rows: tuple[str, ...]
    judged: frozenset[str]
    command: Callable[..., list[str]]
    two_process_env: Callable[[], dict[str, str]]
    weights: str
    prepare: Callable[[Path], None] = lambda work: None
    base_env: dict[str, str] = field(default_factory=dict)
    # a row's own variables for its ZEROFIX=1 run (a statement to zerofix, as a user of the framework would set it)
    zerofix_env: Callable[[str], dict[str, str]] = lambda row: {}
    # rows that train an adapter (LoRA): the weights before the step come from the big batch's command at learning rate
    # 0 (variant ``init``: an adapter's initial values are in no file of the model), and ``command`` takes ``lr=``
    adapters: frozenset[str] = frozenset()
    # the folder of the model a row trains (its weights before the step): tiny_model's, unless a row names another
    model_of: Callable[[Path, str], Path] = lambda work, row: work / "model"

    def split(self, name: str) -> tuple[str, str | None]:
        """``sft@zero2`` -> ("sft", "zero2"); ``sft`` -> ("sft", None)."""
        row, _, layout = name.partition("@")
        if row not in self.rows or (layout and layout not in LAYOUTS):
            raise SystemExit(f"unknown row {name!r}: rows {sorted(self.rows)}, layouts @{', @'.join(LAYOUTS)}")
        return row, layout or None

    def reference_name(self, name: str) -> str:
        """Where row ``name``'s reference runs: its own folder on one process; ``row@16`` for every 2-process
        layout."""
        row, layout = self.split(name)
        return f"{row}@16" if layout else name

    # the suite's command line and its docs table, for the suites' __main__ and the tests
    def main(self, argv=None) -> int:
        import tiny_model  # beside this file

        return main(self, tiny_model, argv)

    def doc_rows(self, path: Path | None = None) -> dict[str, str]:
        return doc_rows(self, path or DOCS)

    def write_docs(self, results: list[dict], path: Path | None = None) -> None:
        write_docs(self, results, path or DOCS)

    def markers(self) -> tuple[str, str]:
        return markers(self)

    def table_row(self, result: dict) -> str:
        return table_row(result)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def deepspeed_file(work: Path, layout: str, config: dict) -> Path:
    """A layout's DeepSpeed config, written where a framework's YAML names it: ``work/ds_<layout>.json``."""
    path = work / f"ds_{layout}.json"
    path.write_text(json.dumps(config, indent=1))
    return path


def zerofix_lines(log: str) -> list[str]:
    """What zerofix said in the run's console (the Trainer log's lines and the zerofix logger's)."""
    return [line for line in log.splitlines() if "zerofix: " in line]


def run(fw: Framework, work: Path, name: str, variant: str, reuse: bool = False) -> dict:
    """One run of row ``name`` (``row[@layout]``): ``big`` (the reference: one process, the whole batch at once),
    ``plain`` or ``zerofix`` (accumulated, in the layout); for an adapter row also ``init`` (the big batch's command at
    learning rate 0: the adapter's weights before the step)."""
    row, layout = fw.split(name)
    two = layout is not None
    whole = variant in ("big", "init")
    gas, batch = (1, 16 if two else 8) if whole else (4, 2)
    where = fw.reference_name(name) if whole else name  # one reference for a row's 2-process layouts
    out = work / "runs" / where / variant
    log_file = work / "runs" / where / f"{variant}.log"
    found = glob.glob(str(out / fw.weights))
    if reuse and found and log_file.exists():
        return {"row": name, "variant": variant, "rc": 0, "weights": found[0],
                "zerofix_lines": zerofix_lines(log_file.read_text())}
    env = {**os.environ, **fw.base_env, "OMP_NUM_THREADS": "1"}
    # as an activated environment has it: a framework may launch its stack's own `torchrun` by name (LLaMA-Factory)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    for key in ("ZEROFIX", "ZEROFIX_HAND_COUNT_TO_MODEL", "NPROC_PER_NODE", "FORCE_TORCHRUN"):
        env.pop(key, None)
    if variant == "zerofix":
        env.update(fw.zerofix_env(row), ZEROFIX="1")
    if two and variant != "big":
        env.update(fw.two_process_env(), MASTER_PORT=str(free_port()))
    cmd = fw.command(work, row, out, gas, batch, None if whole else layout, sixteen=two,
                     **({"lr": 0.0} if variant == "init" else {}))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    log = done.stdout + done.stderr
    log_file.write_text(log)
    found = glob.glob(str(out / fw.weights))
    return {"row": name, "variant": variant, "rc": done.returncode, "weights": found[0] if found else None,
            "zerofix_lines": zerofix_lines(log)}


def update(weights: str, initial) -> "torch.Tensor":  # noqa: F821
    """The step's update: ``weights`` less ``initial`` (the model's weights, or an adapter's before the step)."""
    import torch
    from safetensors.torch import load_file

    init, end = load_file(initial), load_file(weights)
    # the parameters both have (a reward model's score head is new: its backbone's update is compared)
    return torch.cat([(end[k].double() - init[k].double()).flatten() for k in sorted(init) if k in end])


def bitwise(a: str, b: str) -> bool:
    """Whether two runs saved the same weights, bit for bit."""
    from safetensors.torch import load_file

    x, y = load_file(a), load_file(b)
    return x.keys() == y.keys() and all(x[k].equal(y[k]) for k in x)


def main(fw: Framework, tiny_model, argv=None) -> int:
    p = argparse.ArgumentParser(prog=f"{fw.name} suite")
    p.add_argument("out")
    p.add_argument("rows", nargs="*", default=list(fw.rows))
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--reuse", action="store_true", help="compare the runs OUT_DIR already holds, running only the rest")
    p.add_argument("--write-docs", action="store_true", help="write the measured rows into docs/frameworks.md's table")
    args = p.parse_args(argv)
    work = Path(args.out).resolve()
    work.mkdir(parents=True, exist_ok=True)
    if not (args.reuse and (work / "model").exists()):
        tiny_model.build(work)
        fw.prepare(work)
    for name in args.rows:
        for where in (name, fw.reference_name(name)):
            (work / "runs" / where).mkdir(parents=True, exist_ok=True)
    references = {fw.reference_name(name): name for name in args.rows}  # each reference runs once
    jobs = [(name, "big") for name in references.values()]
    jobs += [(name, "init") for name in references.values() if fw.split(name)[0] in fw.adapters]
    jobs += [(row, v) for row in args.rows for v in ("plain", "zerofix")]
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(lambda job: run(fw, work, *job, reuse=args.reuse), jobs))
    by = {(r["row"], r["variant"]): r for r in runs}
    results = []
    for row in args.rows:
        big = by[(references[fw.reference_name(row)], "big")]
        init = by.get((references[fw.reference_name(row)], "init"))
        initial = init["weights"] if init else fw.model_of(work, fw.split(row)[0]) / "model.safetensors"
        entry = {"row": row, "judged": fw.split(row)[0] in fw.judged}
        for variant in ("plain", "zerofix"):
            ran = by[(row, variant)]
            if not (ran["weights"] and big["weights"] and initial):
                entry[variant] = {"error": f"rc {ran['rc']} / {big['rc']}: see runs/{row}/{variant}.log"}
                continue
            entry[variant] = comparison(update(ran["weights"], initial), update(big["weights"], initial))
        plain, fixed = by[(row, "plain")]["weights"], by[(row, "zerofix")]["weights"]
        entry["bitwise_as_unpatched"] = bool(plain and fixed) and bitwise(plain, fixed)
        entry["zerofix_lines"] = by[(row, "zerofix")]["zerofix_lines"]
        results.append(entry)
    (work / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    print(HEADER)
    for r in results:
        print(table_row(r))
    if args.write_docs:
        write_docs(fw, results)
        print(f"written into {DOCS}")
    return 0


# docs/frameworks.md's tables, generated: write_docs replaces the rows it measured and keeps the others
BEGIN = "<!-- {name}-table: generated by tools/frameworks/{name}_suite.py --write-docs -->"
END = "<!-- /{name}-table -->"
HEADER = "| run | unpatched | `ZEROFIX=1` | zerofix said |\n|---|---|---|---|"
SAID = (("a coincidence, not a statement", "GAS read as a coincidence: upstream's update"),
        ("scales it as a micro-batch mean", "loss rescaled as a micro-batch mean"),
        ("averages a term over its own micro-batch", "WARNING: a micro-batch mean term"),
        ("which its library defines as normalised by", "WARNING: a local-batch loss by definition"),
        ("-withheld-count acts on this run", "the framework's flag, its known bug: the count handed to the model's "
                                             "loss"),
        ("because the Trainer never hands num_items_in_batch to", "the count handed to the model's loss"))


def said(result: dict) -> str:
    """What zerofix's console lines said of the row's loss, in a few words (a framework entry's line says the count's
    handing itself)."""
    lines = "\n".join(result.get("zerofix_lines", ()))
    shorts = [short for marker, short in SAID if marker in lines]
    if any("its known bug" in s for s in shorts):
        shorts = [s for s in shorts if s != "the count handed to the model's loss"]
    return "; ".join(shorts) or "-"


def table_row(result: dict) -> str:
    return (f"| `{result['row']}` | {cell(result['plain'], result['judged'])} | "
            f"{cell(result['zerofix'], result['judged'])} | {said(result)} |")


def markers(fw: Framework) -> tuple[str, str]:
    return BEGIN.format(name=fw.name), END.format(name=fw.name)


def doc_rows(fw: Framework, path: Path = DOCS) -> dict[str, str]:
    """The framework's generated table's rows in the docs, by row name."""
    begin, end = markers(fw)
    text = path.read_text()
    if begin not in text:
        return {}
    body = text.split(begin, 1)[1].split(end, 1)[0]
    return {line.split("`")[1]: line for line in body.splitlines() if line.startswith("| `")}


def write_docs(fw: Framework, results: list[dict], path: Path = DOCS) -> None:
    begin, end = markers(fw)
    rows = doc_rows(fw, path)
    rows.update({r["row"]: table_row(r) for r in results})
    order = [f"{row}{suffix}" for suffix in ("", *(f"@{layout}" for layout in LAYOUTS)) for row in fw.rows]
    table = "\n".join([HEADER, *(rows[name] for name in order if name in rows)])
    text = path.read_text()
    if begin not in text:
        raise SystemExit(f"{path} has no {begin} marker")
    head, rest = text.split(begin, 1)
    path.write_text(head + begin + "\n" + table + "\n" + end + rest.split(end, 1)[1])


if __name__ == "__main__":
    sys.exit("a library of the framework suites: run swift_suite.py or llamafactory_suite.py")
