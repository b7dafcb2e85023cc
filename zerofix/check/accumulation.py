"""Raw DeepSpeed accumulation loops as data: what each rank calls, and which updates they mean.

A *cell* is one loop (style, config GAS, ZeRO stage, optimizer). ``ops(cell)`` is the exact sequence of
calls the scenario makes on every rank; ``updates(cell, semantics)`` lists, per optimizer update, the
micro-steps it applies and the weight of each micro-step's mean loss in it. The reference trains on
those in one float64 process. Pure Python: shared by the scenario, the reference and the tests.

Loop styles (2 windows unless noted):
  a  4 backwards then step()
  b  backward + step() per micro-batch (DeepSpeed's documented style)
  c  (a) with set_gradient_accumulation_boundary(i == last) before each backward (open-instruct's fix)
  d  3 backwards then step()
  e  (a) with gradient clipping on
  f  (b) with gradient clipping on
  g  (b) with two backwards per micro-batch: two losses, 0.25 and 0.75 of the micro-batch's loss, each from
     its own forward, step() after the second (DeepSpeed's own style with several backwards per micro-batch;
     a ``retain_graph=True`` backward cannot run twice under ZeRO-3 on CPU, with or without zerofix)
  short  an epoch of 10 micro-batches in windows of 4: the last window has 2 (config GAS=1)
  coalesce  (a) inside ``with engine.coalesce_grad_reduction():`` (DeepSpeed >= 0.19.7, ZeRO-1/2/3)
  nosync  3 backwards inside ``with engine.no_sync():``, the 4th outside, step() (ZeRO-0/1, DeepSpeed >= 0.16)
  zg  DeepSpeed's ``test_multiple_ctxts``, then a step(): 4 backwards inside no_sync(), ``zero_grad()``,
      3 inside no_sync() and one outside, step(): the update is the last 4 micro-batches' (windows of 8)
  z  a backward, ``zero_grad()``, 3 backwards, step(): the update is the last 3 micro-batches'
With config GAS=1 the loop divides each loss by its window's length itself (as open-instruct does);
with config GAS=K DeepSpeed divides by K (``scale_wrt_gas``), whatever the window's length. A cell with
``scale_wrt_gas=False`` divides by K itself and tells DeepSpeed not to, as the Trainer does.
"""
from __future__ import annotations

from typing import NamedTuple

from zerofix.versions import version_in_range

STYLES = ("a", "b", "c", "d", "e", "f", "g", "short", "coalesce", "nosync", "zg", "z")
OWN_STYLES = ("b", "f", "g")  # backward + step() per micro-batch
# several unflagged backwards per step(), outside DeepSpeed's no_sync() / coalesce_grad_reduction()
MANUAL_STYLES = ("a", "d", "e", "short", "z")
CORRECT, LAST, NOOP, DOUBLE, TRIPLE, ERROR = "correct", "last", "noop", "double", "triple", "error"
# ZeRO-1/2's step() in grad mode on 0.18.7 - 0.18.9 (2+ gloo ranks): RuntimeError "Output 0 of Split is a view"
SPLIT = "split"
# DeepSpeed's own style with two backwards per micro-batch under ZeRO-1/2 from 0.17.6: the window's last
# micro-batch runs both its backwards as boundaries and the second replaces the first (update error 0.87,
# measured 0.18.9 and 0.19.8; 0.16.3's epilogue adds both: right)
TWICE = "twice"
# ZeRO-1/2 optimizer offload: only each window's first and last micro-batch survive (ENDS), every one but
# the first (TAIL), or an update no simple rule describes (WRONG: far from both CORRECT and LAST); see
# known_unpatched()
ENDS, TAIL, WRONG = "ends", "tail", "wrong"
# ZeRO-1 bf16 with an fp32 gradient accumulator (BF16_Optimizer) on 0.18.5 - 0.18.9: each boundary micro-batch
# reaches the update unaveraged, each rank's own in the partition it owns (deepspeed-bf16-boundary-reduction);
# no per-window reference describes it, the measured errors do (MEASURED_UNAVERAGED)
UNAVERAGED = "unaveraged"
# bf16 through FP16_UnfusedOptimizer (bf16_unfused()) on 0.18.3 - 0.18.5: its dynamic loss scale divides a
# gradient nobody scaled, no update at all (DeepSpeed #7837, fixed in 0.18.6; deepspeed-bf16-loss-scale)
NO_UPDATE = "no-update"
# the same optimizer under ZeRO-0 on 0.17.6 - 0.18.2: never zeroed, each window's gradient carries every earlier one
# (computed at earlier weights, which no per-window reference describes: the measured errors do, MEASURED_CARRIED)
CARRIED = "carried"
# ... and its checkpoints on 0.17.6 - 0.18.4 hold no optimizer state: a resumed engine keeps the fp32 master weights
# it was built with, so its first step puts them back (bf16_checkpoint_drops_optimizer(); not fixed by zerofix)
LOST = "lost"
EXTRA_DIVISIONS = {DOUBLE: 1, TRIPLE: 2}  # how many more times than meant each loss is divided by GAS


class Cell(NamedTuple):
    stage: int
    gas: int  # gradient_accumulation_steps in the DeepSpeed config
    style: str
    optimizer: str = "sgd"  # sgd | adamw
    overlap_comm: bool = False
    resume: bool = False  # save a checkpoint after the first window, load it into a fresh engine
    logits: bool = False  # the model returns its logits next to the loss (loss only by default)
    scale_wrt_gas: bool = True  # False: the loop divides by GAS and passes scale_wrt_gas=False
    windows: int = 2  # how many windows (styles a-e)
    repeat: bool = False  # every window trains on the first window's samples (a loss curve that can fall)
    probe: bool = False  # record every observable (zerofix.check.scenarios.ds_accumulation.Probe)
    direct: bool = False  # the loop calls loss.backward() itself (torch-style backward, ZeRO-1/2/3 >= 0.18.3)
    offload: bool = False  # ZeRO-1/2 optimizer offload to CPU (the torch optimizer runs on the fp32 partition)
    dtype: str = "fp32"  # fp32 | bf16 | fp16: DeepSpeed's mixed-precision optimizers (fp32 master weights)
    length: int = 0  # micro-batches per window (0: the style's, 4 or 3); a user configuration's GAS
    grad_clip: float | None = None  # gradient_clipping (None: the style's, CLIP for e/f, else 0)
    # bf16 with "data_types": {"grad_accum_dtype": "fp32"}: ZeRO-1 then runs DeepSpeed's BF16_Optimizer
    accum_fp32: bool = False
    # engine.step() in grad mode, as the Trainer and accelerate call it (by default the loop calls it under
    # torch.no_grad(), where DeepSpeed 0.18.7 - 0.18.9's ZeRO-1/2 step runs on gloo: split_view_crash())
    grad_step: bool = False

    @property
    def name(self) -> str:
        overlap = "-overlap" if self.overlap_comm else ""
        resume = "-resume" if self.resume else ""
        logits = "-logits" if self.logits else ""
        scaled = "" if self.scale_wrt_gas else "-selfscaled"
        windows = "" if self.windows == 2 else f"-w{self.windows}"
        repeat = "-repeat" if self.repeat else ""
        probe = "-probe" if self.probe else ""
        direct = "-direct" if self.direct else ""
        offload = "-offload" if self.offload else ""
        dtype = "" if self.dtype == "fp32" else f"-{self.dtype}"
        length = f"-len{self.length}" if self.length else ""
        clip = "" if self.grad_clip is None else f"-clip{self.grad_clip:g}"
        accum = "-acc32" if self.accum_fp32 else ""
        grad_step = "-gradstep" if self.grad_step else ""
        return (f"z{self.stage}{overlap}-gas{self.gas}-{self.style}-{self.optimizer}{resume}{logits}{scaled}"
                f"{windows}{repeat}{probe}{direct}{offload}{dtype}{accum}{length}{clip}{grad_step}")

    @property
    def clip(self) -> float:
        if self.grad_clip is not None:
            return self.grad_clip
        return CLIP if self.style in ("e", "f") else 0.0

    @property
    def own_style(self) -> bool:
        return self.style in OWN_STYLES


CLIP = 0.05  # below every window's gradient norm in these cells, so clipping is active
MICRO_BATCH = 2  # samples per rank per micro-step


def window_lengths(cell: Cell) -> list[int]:
    if cell.style == "short":
        return [4, 4, 2]
    return [cell.length or {"d": 3, "zg": 8}.get(cell.style, 4)] * cell.windows


def counted(cell: Cell, steps: list[int]) -> list[int]:
    """The micro-steps of a window whose gradients its update applies (``zero_grad()`` discards the rest)."""
    return {"zg": steps[4:], "z": steps[1:]}.get(cell.style, steps)


def ops(cell: Cell) -> list[tuple]:
    """("backward", micro_step, loss_divisor, explicit_boundary or None, share of the micro-batch's loss),
    ("step", window_done), ("enter", "no_sync" | "coalesce"), ("exit",) and ("zero_grad",)."""
    out, m = [], 0
    for length in window_lengths(cell):
        m = 0 if cell.repeat else m
        steps = list(range(m, m + length))
        m += length
        kept = len(counted(cell, steps))
        divisor = (kept if cell.gas == 1 and not cell.own_style else 1) * (1 if cell.scale_wrt_gas else cell.gas)

        def backward(s, share=1.0):
            explicit = (s == steps[-1]) if cell.style == "c" else None
            return ("backward", s, divisor, explicit, share)

        if cell.style == "g":
            for s in steps:
                out += [backward(s, 0.25), backward(s, 0.75), ("step", s == steps[-1])]
        elif cell.own_style:
            for s in steps:
                out += [backward(s), ("step", s == steps[-1])]
        elif cell.style == "coalesce":
            out += [("enter", "coalesce"), *map(backward, steps), ("exit",), ("step", True)]
        elif cell.style == "nosync":
            out += [("enter", "no_sync"), *map(backward, steps[:-1]), ("exit",), backward(steps[-1]), ("step", True)]
        elif cell.style == "zg":
            out += [("enter", "no_sync"), *map(backward, steps[:4]), ("exit",), ("zero_grad",),
                    ("enter", "no_sync"), *map(backward, steps[4:-1]), ("exit",), backward(steps[-1]), ("step", True)]
        elif cell.style == "z":
            out += [backward(steps[0]), ("zero_grad",), *map(backward, steps[1:]), ("step", True)]
        else:
            out += [*map(backward, steps), ("step", True)]
    return out


def updates(cell: Cell, semantics: str = CORRECT) -> list[list[list[tuple[int, float]]]]:
    """Per window, the optimizer updates it makes; per update, ``(micro_step, weight)`` pairs: the
    update's gradient is sum(weight * grad(mean loss of that micro-step)), averaged over ranks.
    ``semantics``: ``correct``, ``last`` (only each window's last micro-batch survives), ``noop``
    (step() never updates), ``double`` / ``triple`` (every loss divided by the config GAS once / twice
    more than meant)."""
    result, m = [], 0
    for length in window_lengths(cell):
        m = 0 if cell.repeat else m
        steps = counted(cell, list(range(m, m + length)))
        m += length
        if semantics in (NOOP, NO_UPDATE):
            result.append([])

        elif cell.own_style and cell.gas == 1:
            result.append([[(s, 1.0)] for s in steps])
        else:
            divisor = (len(steps) if cell.gas == 1 else 1) * cell.gas ** (1 + EXTRA_DIVISIONS.get(semantics, 0))
            if semantics == TWICE:  # only the last micro-batch's last share (0.75, ops()) survives
                result.append([[(steps[-1], 0.75 / divisor)]])
                continue
            kept = {LAST: steps[-1:], ENDS: steps[:1] + steps[-1:], TAIL: steps[1:]}.get(semantics, steps)
            result.append([[(s, 1.0 / divisor) for s in kept]])
    return result


def snapshots(cell: Cell) -> int:
    """How many parameter snapshots the scenario records: one after each window."""
    return len(window_lengths(cell))


def sample_indices(micro_step: int, rank: int, world: int) -> list[int]:
    first = (micro_step * world + rank) * MICRO_BATCH
    return list(range(first, first + MICRO_BATCH))


def matrix(optimizers=("sgd", "adamw")) -> list[Cell]:
    """The issue's matrix: ZeRO 0, 1, 2 (overlap_comm off/on) and 3 x config GAS {1, 4} x styles a-e."""
    stages = [(0, False), (1, False), (2, False), (2, True), (3, False)]
    # DeepSpeed's own style and the config-GAS=4 manual loop (followed) are probed (every observable recorded)
    # here already: transparency_matrix() and ambiguity_cells() reuse these cells rather than building their
    # engines twice
    return [Cell(stage, gas, style, opt, overlap,
                 probe=style == "b" or (style == "a" and gas > 1 and opt == "sgd" and not overlap))
            for stage, overlap in stages for gas in (1, 4) for style in "abcde" for opt in optimizers]


def transparency_matrix(deepspeed_version: str) -> list[Cell]:
    """Every loop DeepSpeed gets right by itself, probed: its own style (backward + step per micro-batch)
    at config GAS 1 and 4, ZeRO 0-3 with overlap_comm off/on, SGD and AdamW, with and without clipping,
    and manual accumulation where the stage accumulates by itself (config GAS=1: ZeRO-0/3, and ZeRO-1/2
    before 0.17.6). zerofix must leave every observable of these as DeepSpeed makes it."""
    stages = [(0, False), (1, False), (1, True), (2, False), (2, True), (3, False)]
    own = [Cell(stage, gas, "b", opt, overlap, probe=True) for stage, overlap in stages for gas in (1, 4)
           for opt in ("sgd", "adamw")]  # matrix() holds all but ZeRO-1 with overlap_comm
    clipped = [Cell(stage, 4, "f", "sgd", overlap, probe=True) for stage, overlap in stages]
    accumulating = [Cell(stage, 1, "a", "sgd", probe=True) for stage in (0, 1, 2, 3)
                    if not zerofix_takes_over(Cell(stage, 1, "a"), deepspeed_version)]
    # optimizer offload, where DeepSpeed's own style is right (ZeRO-1; ZeRO-2 from 0.19.0 or at GAS=1)
    offload = [c for c in offload_cells() if c.own_style and c.probe
               and known_unpatched(c, deepspeed_version) == CORRECT]
    # a model returning its logits, wherever DeepSpeed divides its gradient once (deepspeed-output-hook-
    # division then divides at the loss instead of DeepSpeed's hook: the same operation on the same tensor)
    logits = [Cell(stage, gas, "b", "sgd", logits=True, probe=True) for stage in (0, 1, 2, 3) for gas in (1, 4)
              if not output_hook_divides_twice(Cell(stage, gas, "b", logits=True), deepspeed_version)]
    # bf16 ZeRO-1 without the fp32 accumulator (DeepSpeedZeroOptimizer): deepspeed-bf16-boundary-reduction's wrapper
    # runs around every backward epilogue of its range and must pass this optimizer through untouched
    bf16 = [Cell(1, 4, "b", "sgd", probe=True, dtype="bf16")]
    return own + clipped + accumulating + logits + offload + bf16


def takeover_probes(deepspeed_version: str) -> list[Cell]:
    """Manual accumulation where zerofix takes over, probed: a gradient read before step() must be the
    window's mean gradient (DeepSpeed's own style reads it so). ZeRO-0's reads are local, in DeepSpeed
    and with zerofix (no collective is added to a read that has none)."""
    return [Cell(stage, gas, "a", "sgd", probe=True, offload=offload) for stage in (1, 2, 3) for gas in (1, 4)
            for offload in (False, True) if (stage < 3 or not offload)
            and zerofix_takes_over(Cell(stage, gas, "a", offload=offload), deepspeed_version)]


def engine_may_take_over(cell: Cell, deepspeed_version: str) -> bool:
    """Whether deepspeed-manual-accumulation is active on the cell's engine: ZeRO-1/2 at config GAS=1 where a
    boundary replaces the reduced gradient (from 0.17.6; with optimizer offload on every release). At config
    GAS > 1 a manual loop looks like DeepSpeed's own style with several backwards per micro-batch; ZeRO-0/3,
    ZeRO-1/2 before 0.17.6 and the BF16_Optimizer accumulate by themselves at GAS=1."""
    return (cell.stage in (1, 2) and cell.gas == 1 and not bf16_fp32_accumulator(cell)
            and (cell.offload or boundary_replaces(deepspeed_version)))


def bf16_fp32_accumulator(cell: Cell) -> bool:
    """ZeRO-1 in bf16 with ``grad_accum_dtype`` fp32 and no offload, for which DeepSpeed means its BF16_Optimizer
    (an fp32 accumulator each backward's bf16 gradients are added into); ZeRO-2/3 and offload keep their own.
    Measured: 0.16.3 and 0.18.5+ build it; 0.18.0 - 0.18.4 build FP16_UnfusedOptimizer instead, because their
    constants BFLOAT16 and DDP_BFLOAT16 are both "bf16" and the engine tests for the second first. Neither it nor
    zerofix's manual-accumulation fix (it has no all_grad_tensors) needs a takeover: every backward is added."""
    return cell.dtype == "bf16" and cell.accum_fp32 and cell.stage == 1 and not cell.offload


def split_view_crash(cell: Cell, deepspeed_version: str) -> bool:
    """ZeRO-1/2 build their flat parameter buffer from the parameters themselves on 0.18.7 - 0.18.9, with an
    autograd graph, and step() in grad mode then raises on gloo (deepspeed-zero12-flat-buffer; measured 0.18.7 -
    0.18.9 on 2 ranks, fp32 and bf16; 0.18.6 and 0.19.0 run)."""
    return cell.grad_step and cell.stage in (1, 2) and version_in_range(deepspeed_version, ">=0.18.7,<0.19.0")


def flat_buffer_cells() -> list[Cell]:
    """ZeRO-1/2 with engine.step() in grad mode (deepspeed-zero12-flat-buffer's range and both sides of it):
    DeepSpeed's own style at GAS=4 in fp32 and bf16, and manual accumulation at config GAS=1."""
    return [Cell(stage, 4, "b", dtype=dtype, grad_step=True) for stage in (1, 2) for dtype in ("fp32", "bf16")] + [
        Cell(stage, 1, "a", grad_step=True) for stage in (1, 2)]


def bf16_unfused(cell: Cell, deepspeed_version: str) -> bool:
    """Whether the engine trains the bf16 cell with FP16_UnfusedOptimizer, the fp16 optimizer (measured by the
    optimizer's class): ZeRO-0 from 0.17.6 (DeepSpeed's DDP_BFLOAT16 wrapper; 0.17.5 wraps nothing), and the
    ZeRO-1 fp32-accumulator configuration on 0.17.6 - 0.18.4 (bf16_fp32_accumulator()). Up to 0.18.5 it keeps
    fp16's loss scale and, under ZeRO-0, its gradients across steps (deepspeed-bf16-loss-scale)."""
    if cell.dtype != "bf16" or not version_in_range(deepspeed_version, ">=0.17.6"):
        return False
    return cell.stage == 0 or (bf16_fp32_accumulator(cell) and version_in_range(deepspeed_version, "<0.18.5"))


def bf16_unfused_broken(cell: Cell, deepspeed_version: str) -> str | None:
    """What FP16_UnfusedOptimizer does to the bf16 cell before 0.18.6 (DeepSpeed #7837): NO_UPDATE on 0.18.3 -
    0.18.5 (engine.backward no longer applies the loss scale step() divides by), CARRIED under ZeRO-0 on 0.17.6 -
    0.18.2 (never zeroed; the scale is applied; a resumed engine starts without gradients, so its window is right),
    None where it is right (measured 0.17.5, 0.17.6, 0.18.0, 0.18.2, 0.18.3, 0.18.5, 0.18.6)."""
    if not bf16_unfused(cell, deepspeed_version) or not version_in_range(deepspeed_version, "<0.18.6"):
        return None
    if version_in_range(deepspeed_version, ">=0.18.3"):
        return NO_UPDATE
    return CARRIED if cell.stage == 0 and not cell.resume else None


def bf16_checkpoint_drops_optimizer(cell: Cell, deepspeed_version: str) -> bool:
    """A ZeRO-0 bf16 checkpoint resumed on 0.17.6 - 0.18.4: the engine counts bf16 as ZeRO optimizer state
    (``zero_optimization() or bfloat16_enabled()``) and saves FP16_UnfusedOptimizer's state nowhere, so the resumed
    engine's first step writes back the master weights of the model it was built from (measured 0.18.0, 0.18.3:
    update error 5.07 after the resumed window; 0.18.5 tests zero_optimization() alone: right)."""
    return (cell.resume and cell.stage == 0 and bf16_unfused(cell, deepspeed_version)
            and version_in_range(deepspeed_version, "<0.18.5"))


def bf16_boundary_unaveraged(cell: Cell, deepspeed_version: str) -> bool:
    """0.18.5 - 0.18.9 all-reduce the BF16_Optimizer's accumulator before the boundary micro-batch is added
    (deepspeed-bf16-boundary-reduction; the method is broken from 0.18.3, the optimizer built from 0.18.5):
    measured 0.18.9; 0.16.3 adds first, 0.19.8 is right."""
    return bf16_fp32_accumulator(cell) and version_in_range(deepspeed_version, ">=0.18.5,<0.19.0")


def zerofix_takes_over(cell: Cell, deepspeed_version: str) -> bool:
    """Whether deepspeed-manual-accumulation reduces the cell's windows itself: several unflagged backwards
    per step() outside DeepSpeed's no_sync() / coalesce_grad_reduction(), on an engine it is active on."""
    return cell.style in MANUAL_STYLES and engine_may_take_over(cell, deepspeed_version)


def output_hook_divides_twice(cell: Cell, deepspeed_version: str) -> bool:
    """ZeRO-0/1/2 with config GAS > 1 and a model that returns its logits next to the loss: the engine's
    output-tensor backward hook divides the gradient of *every* output by GAS, and the logits lie on the
    loss's path, so each loss is divided by GAS twice (deepspeed-output-hook-division). Through
    ``engine.backward`` on 0.18.3 - 0.19.5 (0.19.6 divides once at the root; measured 0.18.3, 0.18.9 wrong,
    0.16.3, 0.18.0, 0.19.8 exact), through a direct ``loss.backward()`` on every release from 0.18.3
    (measured 0.18.9 and 0.19.8). Under ``scale_wrt_gas=False`` the hook divides only on 0.18.3."""
    hook_divides = cell.scale_wrt_gas or version_in_range(deepspeed_version, "==0.18.3")
    releases = ">=0.18.3" if cell.direct else ">=0.18.3,<0.19.6"
    return (cell.logits and cell.gas > 1 and cell.stage < 3 and hook_divides
            and version_in_range(deepspeed_version, releases))


def hook_ignores_scale_wrt_gas(cell: Cell, deepspeed_version: str) -> bool:
    """deepspeed 0.18.3's output hook divides by GAS also under ``scale_wrt_gas=False``
    (deepspeed-scale-wrt-gas; 0.18.4 honours the flag)."""
    return not cell.scale_wrt_gas and cell.gas > 1 and version_in_range(deepspeed_version, "==0.18.3")


def accumulator_restarts(deepspeed_version: str) -> bool:
    """ZeRO-1/2's epilogue tests the wrong buffer for an empty accumulator (deepspeed-zero12-accumulator)."""
    return version_in_range(deepspeed_version, ">=0.17.6,<0.18.3")


def boundary_replaces(deepspeed_version: str) -> bool:
    """ZeRO-1/2 from 0.17.6 *assign* the reduced partition at every boundary (before, the epilogue added it):
    a second boundary backward before step() discards the first."""
    return version_in_range(deepspeed_version, ">=0.17.6")


def known_unpatched(cell: Cell, deepspeed_version: str) -> str:
    """What DeepSpeed itself does with the cell's loop (measured 0.14.5 to 0.19.8; docs/fixes.md):
    ``noop`` when the config GAS differs from the backwards per step() and no boundary is flagged;
    on 0.17.6-0.18.2 ``error`` (a TypeError) for ZeRO-1/2 with config GAS=1 and several backwards per
    step(), and ``last`` for ZeRO-2 wherever a window has non-boundary backwards; ``last`` for ZeRO-1/2
    with config GAS=1 and several backwards per step() from 0.18.3 on; ``double`` / ``triple`` where
    the output hook divides once or twice more than meant; optimizer offload: _offload_unpatched()."""
    manual = cell.style in MANUAL_STYLES  # several unflagged backwards per step()
    if manual and cell.gas > 1:
        return NOOP
    if split_view_crash(cell, deepspeed_version):
        return SPLIT
    if bf16_checkpoint_drops_optimizer(cell, deepspeed_version):
        return LOST
    unfused = bf16_unfused_broken(cell, deepspeed_version)
    if unfused:
        return unfused
    if bf16_fp32_accumulator(cell):  # its fp32 accumulator adds every backward, boundary or not
        return UNAVERAGED if bf16_boundary_unaveraged(cell, deepspeed_version) else CORRECT
    if cell.style == "g" and cell.stage in (1, 2) and boundary_replaces(deepspeed_version):
        return TWICE  # the micro-batch's second boundary backward replaces the first (before 0.17.6: adds)
    if cell.offload:
        return _offload_unpatched(cell, deepspeed_version, manual)
    if accumulator_restarts(deepspeed_version):
        if manual and cell.stage in (1, 2):
            return ERROR
        if cell.stage == 2 and (cell.style == "c" or cell.gas > 1):
            return LAST
    extra = output_hook_divides_twice(cell, deepspeed_version) + hook_ignores_scale_wrt_gas(cell, deepspeed_version)
    if extra:
        return DOUBLE if extra == 1 else TRIPLE
    if manual and cell.stage in (1, 2) and boundary_replaces(deepspeed_version):
        return LAST
    return CORRECT


def _offload_unpatched(cell: Cell, deepspeed_version: str, manual: bool) -> str:
    """ZeRO-1/2 with optimizer offload (measured 0.15.4 - 0.19.8). Every boundary replaces the fp32
    partition's gradient: manual accumulation at config GAS=1 keeps the last micro-batch before 0.19.0,
    and from 0.19.0 (the CPU accumulator then runs from the second micro-step on, and carries the previous
    window) neither the window nor its last micro-batch. DeepSpeed's own style at ZeRO-2 with GAS > 2
    keeps only each window's first and last micro-batch on 0.15.2 - 0.18.9 (deepspeed-offload-accumulator)."""
    if manual:
        return WRONG if version_in_range(deepspeed_version, ">=0.19.0") else LAST
    if cell.stage == 2 and cell.gas > 2 and version_in_range(deepspeed_version, ">=0.15.2,<0.19.0"):
        return ENDS
    return CORRECT


def offload_cells() -> list[Cell]:
    """ZeRO-1/2 with optimizer offload to the CPU (a torch optimizer on the fp32 partition): manual
    accumulation at config GAS 1 and 4 (SGD and AdamW; with clipping, 3-micro-batch windows and a short
    last window, SGD), and DeepSpeed's own style at GAS 1 and 4 with and without clipping, probed."""
    manual = [(1, "a", "sgd"), (1, "a", "adamw"), (4, "a", "sgd"), (4, "a", "adamw"), (1, "e", "sgd"),
              (4, "d", "sgd"), (1, "short", "sgd")]
    own = [(1, "b", "sgd"), (4, "b", "sgd"), (4, "f", "sgd")]
    return ([Cell(stage, gas, style, opt, offload=True) for stage in (1, 2) for gas, style, opt in manual]
            + [Cell(stage, gas, style, opt, probe=True, offload=True) for stage in (1, 2) for gas, style, opt in own]
            + [Cell(stage, 4, "b", "adamw", offload=True) for stage in (1, 2)])


def known_patched(cell: Cell, deepspeed_version: str) -> str:
    """With every DeepSpeed fix applied: every window applied, every gradient divided once, except where
    zerofix follows DeepSpeed because a right usage looks the same: several backwards per step() at config
    GAS > 1 (NOOP), and ZeRO-1/2's own style with several backwards per micro-batch (TWICE); and the resumed
    ZeRO-0 bf16 checkpoint that holds no optimizer state (LOST), which no entry fixes."""
    unpatched = known_unpatched(cell, deepspeed_version)
    return unpatched if unpatched in (NOOP, TWICE, LOST) else CORRECT


def ambiguity_cells(deepspeed_version: str) -> list[Cell]:
    """deepspeed-manual-accumulation's ambiguity list as loops, probed where DeepSpeed gets them right (every
    observable must be DeepSpeed's): several backwards per step() at config GAS=4 (DeepSpeed's own style
    with several backwards per micro-batch looks the same), two backwards per micro-batch in DeepSpeed's own
    style, coalesce_grad_reduction() (>= 0.19.7), no_sync() and DeepSpeed's test_multiple_ctxts (>= 0.16),
    and zero_grad() between backwards (taken over, the discarded micro-batch stays discarded)."""
    cells = [Cell(stage, 4, "a", probe=True) for stage in (0, 1, 2, 3)]
    cells += [Cell(stage, 4, "g", probe=stage in (0, 3)) for stage in (0, 1, 2, 3)
              if stage in (0, 3) or not accumulator_restarts(deepspeed_version)]
    cells += [Cell(0, 4, "g", "adamw", probe=True), Cell(3, 4, "g", "adamw", probe=True)]
    if version_in_range(deepspeed_version, ">=0.19.7"):
        cells += [Cell(stage, 1, "coalesce", opt, probe=True) for stage in (1, 2, 3) for opt in ("sgd", "adamw")]
        cells += [Cell(2, 1, "coalesce", probe=True, overlap_comm=True)]
        cells += [Cell(stage, 1, "coalesce", probe=True, offload=True) for stage in (1, 2)]
    if version_in_range(deepspeed_version, ">=0.16.0"):
        cells += [Cell(stage, 1, style, probe=True) for stage in (0, 1) for style in ("nosync", "zg")]
    if version_in_range(deepspeed_version, ">=0.18.3"):
        cells += [Cell(stage, 1, "z") for stage in (1, 2)]
    return cells


def extra_cells() -> list[Cell]:
    """Beyond the matrix: a short last window, a checkpoint resumed at a window boundary, models that
    return their logits, and DeepSpeed's own loop with the loss divided by the loop (scale_wrt_gas=False)."""
    return ([Cell(stage, 1, "short") for stage in (0, 1, 2, 3)]
            + [Cell(stage, 1, "a", "adamw", resume=True) for stage in (0, 1, 2, 3)]
            + [Cell(stage, 4, style, logits=True) for stage in (0, 1, 2, 3) for style in "ab"]
            + [Cell(stage, 4, "b", logits=logits, scale_wrt_gas=False) for stage in (0, 1, 2, 3)
               for logits in (False, True)])


def direct_backward_cells(deepspeed_version: str) -> list[Cell]:
    """DeepSpeed's own loop with ``loss.backward()`` instead of ``engine.backward(loss)`` (the PyTorch-style
    backward, ZeRO-1/2/3 from 0.18.3; earlier releases do not reduce such a backward at all)."""
    if not version_in_range(deepspeed_version, ">=0.18.3"):
        return []
    return [Cell(stage, 4, "b", logits=logits, direct=True) for stage in (1, 2, 3) for logits in (False, True)]


BF16_BOUND = 16 * 2.0 ** -8  # 16 bf16 rounding units: measured 2.2e-2 (ZeRO-0/1/2) and 1.2e-2 (ZeRO-3)


LOSS_SCALE = 2.0 ** 16  # fp16's initial dynamic loss scale, which FP16_UnfusedOptimizer keeps in bf16 before 0.18.6


def bf16_norm_misreported(cell: Cell, deepspeed_version: str) -> bool:
    """0.17.6 - 0.18.2 train bf16 through FP16_UnfusedOptimizer (bf16_unfused()) with fp16's loss scale applied:
    the gradient norm the engine reports is the scaled one, LOSS_SCALE times too large (measured 10486.7 for 0.160
    on 0.17.6, 0.18.0, 0.18.2; deepspeed-bf16-loss-scale)."""
    return bf16_unfused(cell, deepspeed_version) and version_in_range(deepspeed_version, "<0.18.3")


# ZeRO-0 bf16 on 0.17.6 - 0.18.2, unpatched, 2 ranks: the second window's update error against the reference, its
# gradient carrying the first window's (measured 0.17.6, 0.18.0, 0.18.2: the same to 4 digits)
MEASURED_CARRIED = {"z0-gas4-b": 0.7556, "z0-gas4-f": 0.5746, "z0-gas1-a": 0.7602}

# ZeRO-1 bf16 + fp32 accumulator, unpatched, 2 ranks: the first window's update error against the reference
# (data of zerofix.check.models; measured on 0.18.9)
MEASURED_UNAVERAGED = {"z1-gas4-b": 0.559, "z1-gas1-b": 1.019, "z1-gas1-a": 0.559}


def bf16_accumulator_cells() -> list[Cell]:
    """ZeRO-1 bf16 with ``grad_accum_dtype`` fp32 (DeepSpeed's BF16_Optimizer): DeepSpeed's own style at config
    GAS 4 and 1, and manual accumulation at config GAS=1 (each backward a boundary)."""
    return [Cell(1, 4, "b", dtype="bf16", accum_fp32=True), Cell(1, 1, "b", dtype="bf16", accum_fp32=True),
            Cell(1, 1, "a", dtype="bf16", accum_fp32=True)]


def bf16_cells() -> list[Cell]:
    """bf16 (ZeRO-0: DeepSpeed's BF16_Optimizer on 0.16, FP16_UnfusedOptimizer from 0.17.6; bf16 ZeRO-1/2/3; fp16
    does not run on CPU): manual accumulation at config GAS=1 and 4, and DeepSpeed's own style at GAS=4."""
    return [Cell(stage, gas, style, dtype="bf16") for stage in (0, 1, 2, 3) for gas, style in ((1, "a"), (4, "a"), (4, "b"))]


def bf16_loss_scale_cells() -> list[Cell]:
    """ZeRO-0 in bf16 (FP16_UnfusedOptimizer from 0.17.6; deepspeed-bf16-loss-scale's range and both sides of it):
    DeepSpeed's own style at GAS=4 with and without clipping, manual accumulation at config GAS=1, and a checkpoint
    resumed at a window boundary."""
    return [Cell(0, 4, "b", dtype="bf16"), Cell(0, 4, "f", dtype="bf16"), Cell(0, 1, "a", dtype="bf16"),
            Cell(0, 1, "a", resume=True, dtype="bf16")]
