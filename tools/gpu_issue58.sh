#!/usr/bin/env bash
# One device call for issue 58 (docs/measured/gpu-*-2026-11-28-issue58): the chunked-CE table (the blocked path's time
# and peak against Liger-Kernel and cut-cross-entropy), then at once the gpu-marked switch tests (the proof in training
# mode, CUDA's random state) and issue 58's Trainer rows on no engine and FSDP2, bf16 and fp32 (tools/gpu_issue_rows.sh).
#
#   bash tools/gpu_issue58.sh OUTDIR
exec bash "$(dirname "$0")/gpu_issue_rows.sh" "${1:?usage: tools/gpu_issue58.sh OUTDIR}" issue58 \
  "switch or chunked_cross_entropy_parity"
