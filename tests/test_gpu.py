"""The GPU tier (issue 39, item 4): the Trainer x {no engine, FSDP1, FSDP2, ZeRO-2, ZeRO-3} x {bf16, fp16} x
{classifier, causal LM} on CUDA, through tools/gpu_trainer_matrix.py. Marked ``gpu``: it skips without CUDA, and CI
has none (docs/fixes.md, "Paths", says what has and has not been measured on a GPU)."""
from __future__ import annotations


import pytest

from conftest import tool

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU tier)")]


def matrix():
    return tool("gpu_trainer_matrix")


@pytest.mark.parametrize("engine", ["none", "fsdp1", "fsdp2", "zero2", "zero3"])
def test_the_trainer_is_right_patched_on_every_gpu_engine(engine):
    rows = matrix().rows(1, engines=(engine,))
    for row in rows:
        if "skipped" in row:
            pytest.skip(row["skipped"])
        assert "error" not in row, row
        if row["verdict"].startswith("no update"):
            continue  # fp16 loss scaling skipped the one step patched: no verdict on the loss (the table says so)
        assert row["verdict"] in ("fixed", "right (unchanged)"), row
        if row["verdict"] == "right (unchanged)":
            assert row["bitwise_as_unpatched"] in (True, None), row


def test_the_table_names_each_verdict():
    """Runs anywhere the module imports (CUDA present): the verdict of each kind of row."""
    m = matrix()
    assert [m.verdict(1, 1, True, True), m.verdict(4, 1, False, True), m.verdict(1, 4, True, False),
            m.verdict(4, 4, False, False)] == ["right (unchanged)", "fixed", "HARMED", "STILL WRONG"]


@pytest.mark.parametrize("accuracy", ["compact", "accurate", "blocked"])
@pytest.mark.parametrize("chunk_size", [None, 128], ids=["one-chunk", "8-chunks"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_chunked_cross_entropy_parity_on_cuda(dtype, chunk_size, accuracy):
    """Issues 41, 52 and 70: on CUDA the chunked loss of bf16/fp16 weights is float32 and within 2x plain's error
    against float64. Its gradients: as good as plain's where each element is rounded once (the fused path's
    ``accurate`` policy, the blocked path); ``compact`` accumulates the weight's gradient in its dtype chunk by chunk,
    within a rounding per chunk of plain's."""
    from zerofix.losses import function

    assert function.choose_path("cuda", getattr(torch, dtype), "mean") == "fused"  # Triton imports: the fused path
    chosen = function.choose_path
    if accuracy == "blocked":
        function.choose_path = lambda *a: "blocked"
    try:
        errors = _parity_errors(dtype, chunk_size, None if accuracy == "blocked" else accuracy)
    finally:
        function.choose_path = chosen
    assert errors["zerofix"][1] == torch.float32, errors
    assert errors["zerofix"][0] <= 2 * errors["plain"][0] + 1e-7, errors
    chunks = 1 if chunk_size is None else 1024 // chunk_size
    slack = 2.0**-8 * chunks**0.5 if accuracy == "compact" else 1e-4
    assert errors["zerofix"][2] <= 2 * errors["plain"][2] + slack, errors


def _parity_errors(dtype, chunk_size, accuracy):
    import torch.nn.functional as F

    from zerofix import chunked_cross_entropy

    dt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    h64 = torch.randn(1024, 512, generator=g, device="cuda", dtype=torch.float64) * 0.5
    w64 = torch.randn(32000, 512, generator=g, device="cuda", dtype=torch.float64) / 512**0.5
    y = torch.randint(0, 32000, (1024,), generator=g, device="cuda")
    y[::10] = -100
    hq, wq = h64.to(dt).double().requires_grad_(), w64.to(dt).double().requires_grad_()
    ref = F.cross_entropy(hq @ wq.t(), y, ignore_index=-100)
    ref.backward()
    errors = {}
    for name, fn in (("plain", lambda h, w: F.cross_entropy((h @ w.t()).float(), y, ignore_index=-100)),
                     ("zerofix", lambda h, w: chunked_cross_entropy(h, w, y, chunk_size=chunk_size,
                                                                    accuracy=accuracy))):
        h, w = h64.to(dt).requires_grad_(), w64.to(dt).requires_grad_()
        loss = fn(h, w)
        loss.backward()
        errors[name] = (abs(float(loss) - float(ref)) / float(ref), loss.dtype,
                        float((w.grad.double() - wq.grad).norm() / wq.grad.norm()))
    return errors


def test_the_fused_kernel_matches_float64_at_a_real_heads_size():
    """Issue 70: the fused kernel compiled for the GPU, on a block of a real head's vocabulary (128256, one row per
    program, 32768-entry tiles), every option on, against float64 from the same logits (the CPU tests' check,
    tests/test_losses_fused.py, there under Triton's interpreter)."""
    import torch.nn.functional as F

    from zerofix.losses import kernel
    from zerofix.losses.chunked import Options

    g = torch.Generator(device="cuda").manual_seed(0)
    z = torch.randn(64, 128256, generator=g, device="cuda") * 3
    y = torch.randint(0, 128256, (64,), generator=g, device="cuda")
    w = torch.rand(64, generator=g, device="cuda") + 0.5
    w[::4] = 0
    bias = torch.randn(128256, generator=g, device="cuda")
    opt = Options(None, 0.1, 30.0, 1e-4, 1.3, 1.0, True, torch.float32)
    block = z.clone()
    loss, lse, (hit, entropy) = kernel.rows_loss_and_dlogits(block, y, w, bias, opt, True, True)
    raw = z.double().requires_grad_()
    x = 30.0 * torch.tanh((raw + bias.double()) * 1.3 / 30.0)
    ref_lse = torch.logsumexp(x, dim=-1)
    ref = F.cross_entropy(x, y, reduction="none", label_smoothing=0.1) + 1e-4 * ref_lse**2
    (ref * w.double()).sum().backward()
    ref_entropy = ref_lse - (torch.softmax(x, -1) * x).sum(-1)
    assert float((loss.double() - ref).abs().max() / ref.abs().max()) < 2e-5
    assert float((lse.double() - ref_lse).abs().max() / ref_lse.abs().max()) < 2e-5
    assert float((block.double() - raw.grad).abs().max() / raw.grad.abs().max()) < 2e-5
    assert float((entropy.double() - ref_entropy.detach()).abs().max()) < 1e-3
    assert bool((hit.bool() == (x.argmax(-1) == y)).all())


@pytest.mark.parametrize("engine", ["none", "fsdp2"])
def test_issue_51_rows_are_right_on_the_gpu(engine):
    """The identities, a loss that says it is per window, the hand fix, and a never-handed head whose handed step runs
    again (its CUDA random state restored) on the GPU, bf16: fixed or right and unchanged, never harmed."""
    m = matrix()
    for row in m.rows(1, engines=(engine,), dtypes=("bf16",), cells=m.ISSUE51_CELLS):
        assert "error" not in row, row
        assert row["verdict"] in ("fixed", "right (unchanged)"), row


@pytest.mark.parametrize("case", ["z-loss-in-training", "head-dropout", "backbone-dropout"])
def test_the_switch_proves_what_training_runs_on_cuda(case):
    """Issue 58, item 1, on CUDA (the random state restored is the GPU's): a z-loss only in training and dropout before
    the head keep the model's own loss, bitwise with the switch as without; dropout inside the backbone is routed,
    within float32 rounding of the model's own loss and gradients, the same masks drawn."""
    import test_trainer_chunked_loss_unit as unit

    if case == "backbone-dropout":
        model = unit.dropping_out_backbone()
    else:
        model = unit.training_only_model(unit.TrainingZLossLlama if case == "z-loss-in-training" else
                                         unit.HeadDropoutLlama)
    own, own_grads, switched, grads, details = unit.with_and_without_the_switch(model, unit.batch(), "cuda")
    if case == "backbone-dropout":
        assert details[0]["routed"], details
        assert torch.allclose(switched, own, rtol=1e-5), (switched, own)
        for name, grad in own_grads.items():
            assert torch.allclose(grads[name], grad, rtol=1e-3, atol=1e-6), name
        return
    assert not details[0]["routed"], details
    assert torch.equal(switched, own), (switched, own)
    for name, grad in own_grads.items():
        assert torch.equal(grads[name], grad), name


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_an_inline_mean_is_proven_on_cuda_within_its_chunk(dtype):
    """Issue 59: Gemma 3's inline loss at a real head's size on CUDA (4 x 2048 positions, vocabulary 262,144: 8 GiB of
    float32 logits), bf16 logits upcast as Gemma 3 does: the proof finds its count, and its own memory stays within
    a few of its 16 MiB chunks (the step's peak does not move: benchmarks/bench_own_mean_heads.py)."""
    from zerofix import own_mean

    g = torch.Generator(device="cuda").manual_seed(0)
    vocab, b, t = 262144, 4, 2048
    logits = torch.randn(b, t, vocab, device="cuda", dtype=getattr(torch, dtype), generator=g).float()
    labels = torch.randint(0, vocab, (b, t), device="cuda", generator=g)
    labels[:, : t // 3] = -100
    mask = torch.ones_like(labels)
    loss = torch.nn.CrossEntropyLoss()(logits[:, :-1][mask[:, 1:] != 0], labels[:, 1:][mask[:, 1:] != 0])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    proof = own_mean.prove(loss, logits, labels, mask)
    torch.cuda.synchronize()
    grown = (torch.cuda.max_memory_allocated() - before) / 2**20
    assert proof is not None and int(proof.count) == int((labels[:, 1:] != -100).sum())
    assert grown < 4 * own_mean.CHUNK_BYTES / 2**20, grown
    wrong = own_mean.prove(loss + 1e-3 * loss.detach(), logits, labels, mask)
    assert wrong is None


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an SP group of 2 needs 2 GPUs (NCCL refuses two ranks on "
                                                         "one device)")
def test_the_trainer_on_deepspeed_ulysses_trains_the_token_mean_on_nccl(tmp_path):
    """Issue 61 on NCCL: DeepSpeed Ulysses through the Trainer, 2 GPUs (one SP group), fp32, ZeRO-2 and 3 at GA 2;
    unpatched the factor measured on gloo (2x / 1x the mean of micro-batch means), patched the window's token mean."""
    pytest.importorskip("deepspeed")
    import json
    import os
    import subprocess
    import sys

    cells = [{"zero": 2, "gas": 2}, {"zero": 3, "gas": 2}]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZEROFIX", "_ZEROFIX"))}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "zerofix.check.scenarios.sequence_parallel", "--backend", "nccl", "--out", str(tmp_path),
                           "--cells", json.dumps(cells)], env=env, capture_output=True, text=True, timeout=600)
    assert (tmp_path / "result.jsonl").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "result.jsonl").read_text().splitlines()]
    for cell, factor in zip(cells, (2.0, 1.0)):
        bug, fixed = [r for r in rows if r["zero"] == cell["zero"]]
        assert bug["means"]["ratio"] == pytest.approx(factor, rel=1e-3), bug
        assert fixed["token"]["rel_err"] < 1e-4, fixed  # TF32 may be on for CUDA matmuls
