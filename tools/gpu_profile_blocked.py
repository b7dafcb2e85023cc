"""Where the blocked path's time goes on a GPU (issue 58, item 6): zerofix's bf16 forward+backward at the GPU table's
sizes with its default blocks and with larger ones (``chunk_size``: rows per chunk and the same bytes per block), and a
torch.profiler summary of the default at 8192 x 4096 x 128256.

    python tools/gpu_profile_blocked.py OUT.txt
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def main() -> None:
    import torch

    import zerofix
    from bench_chunked_ce import cuda_inputs, cuda_measure

    lines = []
    for n, h, v in ((8192, 4096, 128256), (8192, 4096, 32000)):
        hidden, weight, labels = cuda_inputs(n, h, v, torch.bfloat16)
        for chunk in (None, 512, 1024, 2048, 4096):
            r = cuda_measure(lambda a, b, c: zerofix.chunked_cross_entropy(a, b, c, chunk_size=chunk), hidden, weight,
                             labels, repeats=3, warmup=1)
            lines.append(f"N={n} V={v} chunk={chunk}: {r['ms']:.1f} ms, peak {r['peak_mib']:.0f} MiB")
            print(lines[-1], flush=True)
        if v == 128256:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                zerofix.chunked_cross_entropy(hidden, weight, labels).backward()
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
            lines.append(table)
            print(table, flush=True)
        del hidden, weight, labels
        torch.cuda.empty_cache()
    Path(sys.argv[1]).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
