"""Run a check's plan and judge every row: each job plans its requests (``zerofix.check.jobs``), all of them run in
one batch (one session of ranks per rank count, ``zerofix.check.runner``), each job reads its rows' outcomes, and
``zerofix.check.verdict`` judges them. A job whose run crashed or hung fails its own rows, with that run's cause;
the other jobs' rows are still measured."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from zerofix.check import plan as plans
from zerofix.check import verdict


def run(plan: plans.Plan, *, workdir: Path, timeout: float, found: dict, progress=None,
        timings: dict | None = None) -> list[dict]:
    """One result dict per row, in plan order (skipped rows with their reason); ``timings`` (a dict) is filled with
    where the sessions' time went (``runner.Batch.timings``)."""
    from zerofix.check import jobs, launch, runner

    results, by_job = {}, {}
    for row in plan.rows:
        if row.name in plan.skipped:
            results[row.name] = _result(row, status="skipped", text=f"skipped: {plan.skipped[row.name]}")
        else:
            by_job.setdefault(row.job, []).append(row)
    planned, failures = {}, {}
    for name, rows in by_job.items():
        try:
            planned[name] = jobs.plan(plans.job(name), rows, plan.ranks(name), timeout, workdir, plan.user)
        except Exception as exc:  # noqa: BLE001 - one job's failure must not hide the others' results
            failures[name] = f"{type(exc).__name__}: {exc}"
    # Each job's results are read (references computed) as soon as its own runs have ended, on a worker thread,
    # while the sessions run the others: the ranks leave part of the machine idle.
    waiting = {name: {r.key for r in job_plan.requests} for name, job_plan in planned.items()}
    reader = ThreadPoolExecutor(1)
    read = {}

    def on_outcome(request):  # called under the batch's lock
        for name, keys in waiting.items():
            keys.discard(request.key)
            if not keys and name not in read:
                read[name] = reader.submit(_read, planned[name], batch)

    # The references' libraries, imported while the session's launcher imports its own on the other core: the
    # reader would otherwise import them later, on a core the ranks train on. The reader's own first task, so that
    # no read runs beside it: two threads importing from transformers' lazy module at once lose names ("cannot
    # import name 'LlamaConfig' from 'transformers'", measured on 5.0.0 whenever a job was read mid-import).
    reader.submit(_import_reference_libraries)
    batch = runner.Batch(Path(workdir) / "runs", progress=progress, on_outcome=on_outcome, fork=True)
    for job_plan in planned.values():
        batch.add(*job_plan.requests)
    try:
        batch.run()
        for name, job_plan in planned.items():
            measured, failure = (read[name] if name in read else reader.submit(_read, job_plan, batch)).result()
            seconds = round(sum(batch.outcome(r).seconds or 0.0 for r in job_plan.requests), 1)
            for row in by_job[name]:
                results[row.name] = _row_result(row, measured.get(row.name), failure, seconds, found)
    finally:
        reader.shutdown(cancel_futures=True)
        if timings is not None:
            timings.update(batch.timings())
    for name, failure in failures.items():
        for row in by_job[name]:
            results[row.name] = _row_result(row, None, failure, 0.0, found)
    return [results[row.name] for row in plan.rows]


def _import_reference_libraries() -> None:
    """torch and the model classes the default rows' references build (a library missing here is the rows' own
    error to report, when they run)."""
    try:
        import transformers.models.llama.modeling_llama  # noqa: F401
        import transformers.models.mixtral.modeling_mixtral  # noqa: F401

        from zerofix.check import reference  # noqa: F401 - torch
    except Exception:  # noqa: BLE001, S110 - only a head start
        pass


def _read(job_plan, batch) -> tuple[dict, str | None]:
    """(measured rows, None), or ({}, why nothing could be measured)."""
    import sys

    from zerofix.check import launch

    if "torch" in sys.modules:  # this thread's OpenMP team (zerofix.check.command: why one thread)
        sys.modules["torch"].set_num_threads(1)

    try:
        return job_plan.results(batch), None
    except launch.LaunchError as exc:
        return {}, exc.tail
    except Exception as exc:  # noqa: BLE001 - one job's failure must not hide the others' results
        return {}, f"{type(exc).__name__}: {exc}"


def _result(row, *, status, text, **extra) -> dict:
    return {"name": row.name, "title": row.title, "job": row.job, "status": status, "verdict": text,
            "unpatched": None, "patched": None, "applied": [], "fixes": list(row.fixes), "note": None, **extra}


def _row_result(row, measured, failure, seconds, found) -> dict:
    if measured is None:
        return _result(row, status="failed", text="failed", tail=failure or "no result", seconds=seconds,
                       note=verdict.known_note(row.name, found))
    tolerance = row.tolerance or verdict.TOLERANCE
    unpatched = measured["unpatched"] if row.patchable else None
    status, text = verdict.verdict(unpatched, measured["patched"], measured["applied"], tolerance)
    note = verdict.known_note(row.name, found) if status == "WRONG" else None
    return _result(row, status=status, text=text, unpatched=unpatched, patched=measured["patched"],
                   applied=measured["applied"], note=note, seconds=seconds, tolerance=tolerance)
