"""What the Trainer entry says, in words: every line of ``transformers-trainer-scaling`` and of the decision behind it
(``zerofix.decision``), apart from the rules that choose them (issue 68). Each function returns one message (after
"zerofix: " where the entry prefixes it); nothing here decides, reads a trainer or imports torch."""
from __future__ import annotations

from fractions import Fraction

STATEMENT = "ZEROFIX_LOSS_IS_SCALED_FOR_GA"
HAND_COUNT = "ZEROFIX_HAND_COUNT_TO_MODEL"
FIX_ID = "transformers-trainer-scaling"

# --- the verdict, as the runtime details and the Trainer log name it
VERDICT_SAID = {"divided": "divided by num_items_in_batch", "independent": "independent of num_items_in_batch",
                "unknown": "unknown: follows the Trainer's own path"}
NOT_SEEN = ("not covered: this trainer's training_step does not reach Trainer.training_step (an override without "
            "super()), so zerofix never sees its steps; the Trainer's own scaling runs unchanged")
IF_ALREADY_DIVIDED = ("If your compute_loss already divides it by gradient_accumulation_steps, state it: "
                      "zerofix.loss_is_scaled_for_ga(trainer) or, from the environment, "
                      f"{STATEMENT}=1 (or trainer.loss_is_scaled_for_ga = True on transformers >= 5.19)")


def stood_aside(path) -> str:
    return (f"zerofix: {FIX_ID} stands aside on this run, {path}: the Trainer's own scaling runs unchanged (zerofix "
            "models one process, DDP, DeepSpeed ZeRO-0..3, FSDP1 and FSDP2)")


def unseen() -> str:
    return f"zerofix: {FIX_ID} {NOT_SEEN}"


# --- a run's start
def whose_flag_class(name: str) -> str:
    return f"{name} says accepts_loss_kwargs = False"


def whose_flag_framework(flag, name: str, fix) -> str:
    fixed = f", fixed in {fix.fixed_in}" if fix.fixed_in else ""
    return (f"{flag.setter} ({flag.release}) set model_accepts_loss_kwargs = False for {name}, a known bug of "
            f"{fix.dist} {fix.affected} ({flag.fix_id}{fixed}: {', '.join(fix.upstream)}), not your word")


def whose_flag_user(trainer_name: str, name: str) -> str:
    return (f"{trainer_name} set model_accepts_loss_kwargs = False for {name} and {HAND_COUNT}=1 says that is not "
            "your word")


def handing(whose: str) -> str:
    return (f"zerofix: {whose}, so the Trainer neither counts nor passes num_items_in_batch; zerofix has the Trainer "
            "count and pass it, and keeps it only for steps whose loss is divided by it (a step whose loss is not runs "
            "again as the Trainer runs it)")


def smoothed_never_handed(name: str) -> str:
    return (f"zerofix: {name} says accepts_loss_kwargs = False and this run smooths its labels: the Trainer never "
            "counts num_items_in_batch for it and this release's LabelSmoother takes no count (transformers >= 5.24's "
            "does), so each micro-batch's loss is its own token mean and the update is a mean of micro-batch means "
            "(uneven label counts weigh micro-batches unequally); zerofix leaves it as the Trainer computes it")


def local_batch(loss_type: str, gas: int, processes: int, over: str, window: str) -> str:
    """A loss type normalised over the local batch by definition (after "zerofix: <Trainer> ")."""
    return (f"uses loss_type={loss_type!r}, which its library defines as normalised by {over}: with "
            f"gradient_accumulation_steps={gas} over {processes} process(es) the update averages {gas * processes} "
            f"micro-batch token means, which differs from one mean over the window's tokens wherever micro-batches "
            f"count different numbers of tokens. That is the documented loss, and zerofix leaves it as it is; "
            f"loss_type={window!r} normalises by the window's tokens")


# --- the count handed, checked at every step
def handed_stopped_details(name: str, at: int) -> str:
    return (f"{name}: stopped at optimizer step {at}, the loss is not divided by the count; that micro-batch ran again "
            "without it and every step from there is scaled as a micro-batch mean (the Trainer's own path, or "
            "zerofix's plan where the release divides twice)")


def handed_independent(name: str, at: int) -> str:
    return (f"zerofix: {name}'s loss is independent of num_items_in_batch (its forward computes its own mean, not "
            "through a loss function zerofix can hand the count): zerofix stopped handing it the count at optimizer "
            f"step {at} and ran that micro-batch again without it; from there each step is scaled as a micro-batch "
            "mean is (the Trainer's own path, or zerofix's plan where the release divides twice)")


def handed_unknown(name: str, at: int, route: str) -> str:
    return (f"zerofix: {name} was handed num_items_in_batch at optimizer step {at}, but whether its loss is divided by "
            f"it cannot be told ({route}): that micro-batch ran again without the count, as the Trainer runs it, and "
            "every step from there is the Trainer's own, a mean of micro-batch means (uneven label counts weigh "
            "micro-batches unequally)" + ("" if at == 1 else f"; steps 1-{at - 1} were divided by the count, the token "
                                           "mean") + ". If the loss is divided by num_items_in_batch, say so: "
            f"zerofix.loss_is_scaled_for_ga(trainer) or {STATEMENT}=1")


def to_loss_kept(name: str) -> str:
    return (f"zerofix: {name}'s forward takes num_items_in_batch and calls its loss function without it, so each "
            "micro-batch would take its own token mean: zerofix hands that loss function the count and keeps it only "
            "for steps whose loss is divided by it (a step whose loss is not runs again as the Trainer runs it)")


def to_loss_stopped_details(name: str, at: int) -> str:
    return (f"{name}: stopped at optimizer step {at}, the loss is not divided by the count its loss function was "
            "handed; that micro-batch ran again without it")


def to_loss_stopped(name: str, at: int, why: str) -> str:
    return (f"zerofix: {name}'s loss function was handed num_items_in_batch at optimizer step {at}, and the handing "
            f"cannot stay ({why}): that micro-batch ran again as the Trainer runs it, and nothing more is handed")


def own_mean_details(name: str, tokens: str) -> str:
    return (f"{name}: its inline token mean, proven at each micro-batch equal to the mean cross-entropy of the logits it "
            f"returns over the tokens its {tokens} count, weighed by those tokens over num_items_in_batch (the window's "
            "token mean)")


def own_mean(name: str, tokens: str) -> str:
    return (f"zerofix: {name} computes its own token mean inline, where no count reaches it: at each micro-batch "
            f"zerofix proves that loss is the mean cross-entropy of the logits it returns over the tokens its {tokens} "
            "count, and weighs it by those tokens over num_items_in_batch, so the update is the window's token mean "
            "(upstream's: a mean of micro-batch means)")


def framework_flag_line(setter: str, handed: int, kept: int, stopped: str) -> str:
    """The framework entry's line in the Trainer log (issue 67)."""
    said = f"{setter} set model_accepts_loss_kwargs = False"
    if " stopped at " in stopped:
        return (f"{said}; zerofix had the Trainer hand the model num_items_in_batch, and {stopped} (the framework's "
                "setting is then followed, as upstream runs it)")
    return (f"{said}; zerofix has the Trainer hand the model num_items_in_batch, and its loss was divided by it in "
            f"{kept} of {handed} backwards so far (the window's token mean, as the framework's fixed release trains)")


# --- what a backward's verdict and plan are said as
def unknown(trainer_name: str, route: str, believes_window: bool) -> str:
    return (f"zerofix: whether {trainer_name}'s loss is divided by num_items_in_batch cannot be told: {route}. zerofix "
            "leaves this run to the Trainer's own scaling, which is right only if the Trainer's guess is (it believes "
            f"the loss {'per window' if believes_window else 'a micro-batch mean'}). Say what the loss is: "
            f"zerofix.loss_is_scaled_for_ga(trainer) or {STATEMENT}=1 if it is divided by the count or already divided "
            f"by gradient_accumulation_steps, zerofix.loss_is_scaled_for_ga(trainer, False) or {STATEMENT}=0 if it is "
            "a micro-batch mean (or trainer.loss_is_scaled_for_ga on transformers >= 5.19)")


def rescale(window: int) -> str:
    return f"zerofix scales it as a micro-batch mean (averaged over the window's {window} micro-batches)"


def rescaled(trainer_name: str, said: str) -> str:
    return f"zerofix: {trainer_name}'s loss is independent of num_items_in_batch: {said}. {IF_ALREADY_DIVIDED}"


def loss(trainer_name: str, said: str) -> str:
    return f"zerofix: {trainer_name}'s loss {said}"


# --- a value equal to the accumulation steps (zerofix.decision's coincidences)
_READ = {"already divided": "is independent of num_items_in_batch and its last operation divides it by "
                            "gradient_accumulation_steps ({gas})",
         "carries the steps": "is divided by num_items_in_batch and multiplied by gradient_accumulation_steps ({gas})",
         "divided by the steps": "is divided by num_items_in_batch and by gradient_accumulation_steps ({gas})"}


def reading(found: str, gas: int) -> str:
    """What the loss showed, in words (the runtime details' ``scaled_for_ga`` and the WARNING)."""
    return _READ[found].format(gas=gas)


def _becomes(factor: Fraction) -> str:
    return "it stays this one" if factor == 1 else f"it becomes {float(factor):g}x this one"


def coincidence(found: str, gas: int, *, changes: bool, measured: Fraction, as_read: Fraction) -> str:
    """The one WARNING of a run whose loss shows a coincidence (after "zerofix: <Trainer>'s loss "): what was read,
    that the update is upstream's, what each reading would make of it (``measured``, ``as_read``: relative to
    upstream's), and the statement that decides."""
    said = reading(found, gas)
    if found == "divided by the steps":
        return (f"{said}: the count already covers the accumulation window, so the update is 1/{gas} of the window's "
                f"mean{' (as upstream makes it)' if not changes else ''}. For the window's mean, remove the division by "
                f"gradient_accumulation_steps; if 1/{gas} is a loss weight, say so with {STATEMENT}=1 and this warning "
                "goes")
    if found == "already divided":
        return (f"{said}. That division may be yours for gradient accumulation (the loss already per window) or part "
                f"of a mean (an average of {gas} terms, a loss weight); {gas} is a coincidence zerofix does not act on, "
                f"so the update is the Trainer's own. Say which: {STATEMENT}=1 (or zerofix.loss_is_scaled_for_ga("
                f"trainer)) if the division is for accumulation ({_becomes(as_read)}), "
                f"{STATEMENT}=0 (zerofix.loss_is_scaled_for_ga(trainer, False)) if the loss is a micro-batch mean "
                f"({_becomes(measured)})")
    return (f"{said}. The factor may be a hand fix of a second division by the accumulation steps (transformers 5.2.0 "
            f"- 5.5.3) or a loss weight; {gas} is a coincidence zerofix does not act on, so the update is the Trainer's "
            f"own. If it is a hand fix, remove it: zerofix divides exactly once where a release divides twice (the "
            f"update: {_becomes(as_read).removeprefix('it ')}); if it is a loss weight, say so with {STATEMENT}=1 (or "
            f"zerofix.loss_is_scaled_for_ga(trainer)) and this warning goes ({_becomes(measured)})")


def coincidence_details(read: str, *, held: bool, steps: bool) -> str:
    """The runtime details' ``scaled_for_ga``."""
    if steps:
        return f"{read}; the count already covers the window (the warning above says more)"
    if held:
        return (f"{read}: a coincidence, not a statement, so the update is the Trainer's own (the warning above names "
                "the statement that decides)")
    return f"{read}; read as the user's word or not, zerofix's plan is the same"


# --- a term averaged over its own micro-batch (the window's micro-batch means)
def mean_term(kind: str, counts, where: str, world: int) -> str:
    return (f"a {kind} over {', '.join(map(str, counts))} elements in {where} {len(counts)} micro-batches"
            + (f" over {world} processes" if world > 1 else ""))


NO_COUNT_WITHHELD = "zerofix hands it no count against that setting"
NO_COUNT = "zerofix cannot hand that term a count"


def means_of_means(no_count: str) -> str:
    return ("so with gradient accumulation the update averages micro-batch means where one batch of the window's size "
            f"takes one mean; {no_count}")


def means_upstream(term: str, no_count: str) -> str:
    return (f"averages a term over its own micro-batch ({term}), {means_of_means(no_count)}, and that mean of means "
            "stays as upstream computes it")


def means_rescaled_now(term: str, rescaled_said: str, gave: str, no_count: str) -> str:
    return (f"is independent of num_items_in_batch and averages a term over its own micro-batch ({term}): "
            f"{rescaled_said}, so the update averages micro-batch means {gave} where one batch of the window's size "
            f"takes one mean; {no_count}")


def means_rescaled_before(term: str, gave: str, no_count: str) -> str:
    return (f"averages a term over its own micro-batch ({term}): zerofix scales it as a micro-batch mean (said above), "
            f"{means_of_means(no_count)} {gave}")


def means_stated(term: str, source: str, mean: bool, gave: str, no_count: str) -> str:
    return (f"averages a term over its own micro-batch ({term}); as stated by {source}, zerofix scales it as "
            f"{'a micro-batch mean' if mean else 'per accumulation window'} and the update averages micro-batch means "
            f"{gave} where one batch of the window's size takes one mean; {no_count}")


def gave(factor: float) -> str:
    return f"(the Trainer's own path gave {factor:g}x that)"


def means_unreached(name: str, unproven: bool, said: str) -> str:
    return (f"(computed by {name}, which takes no count: zerofix handed it num_items_in_batch and its forward computes "
            "its own mean, not through a loss function zerofix can hand it"
            + (", and zerofix could not prove that mean from the logits it returns (the only mean it weighs)"
               if unproven else "") + ") " + said)


def means_withheld(who: str, said: str) -> str:
    return (f"(the Trainer hands the model no num_items_in_batch: {who} where the model's forward takes **kwargs, so "
            "the Trainer divides each micro-batch's loss by gradient_accumulation_steps instead; zerofix follows that "
            "setting) " + said)


def withheld_who_framework(flag) -> str:
    return (f"{flag.setter} ({flag.release}) set model_accepts_loss_kwargs = False (a known bug of its releases: "
            f"{flag.fix_id}) and {flag.around} runs around it, so the setting may also be yours")


def withheld_who(trainer_name: str) -> str:
    return f"{trainer_name} set model_accepts_loss_kwargs = False"


MEANS_ADVICE_WITHHELD = (
    "if the model's own loss takes num_items_in_batch (a causal LM's does), say so with "
    f"{HAND_COUNT}=1 (zerofix then hands it the window's count and keeps it only for steps whose loss is divided by "
    "it) or set model_accepts_loss_kwargs = True on the trainer once it is built; or make that term a sum divided by the "
    "window's count (the Trainer's num_items_in_batch)")
MEANS_ADVICE = "make that term a sum divided by the window's count (the Trainer's num_items_in_batch)"


def means(trainer_name: str, said: str, advice: str, tail: str) -> str:
    return (f"zerofix: {trainer_name}'s loss {said}. For the window's mean: {advice}, or train with "
            f"gradient_accumulation_steps=1 and the same total batch.{tail}")


def statement_source(statement, env_statement) -> str:
    """Who said what the loss is, in words: the user's statement (the API or the environment), else the trainer's or
    the model's own attributes."""
    if statement is not None:
        return f"zerofix.loss_is_scaled_for_ga(trainer, {statement})"
    if env_statement is not None:
        return f"{STATEMENT}={int(env_statement)}"
    return "the trainer's or the model's own attributes (loss_is_scaled_for_ga, accepts_loss_kwargs)"
