#!/usr/bin/env bash
# One device call for issues 51 and 52 (docs/measured/gpu-*-2026-11-27-issue51): the chunked-CE table, then issue 51's
# Trainer rows on no engine and FSDP2, bf16 and fp32 (tools/gpu_issue_rows.sh).
#
#   bash tools/gpu_issue51.sh OUTDIR
exec bash "$(dirname "$0")/gpu_issue_rows.sh" "${1:?usage: tools/gpu_issue51.sh OUTDIR}" issue51
