#!/usr/bin/env bash
# One device call for issues 51 and 52 (docs/measured/gpu-*-2026-11-27-issue51): the chunked-CE table against
# Liger-Kernel and cut-cross-entropy (carried as wheels in .whl/common), then issue 51's Trainer rows on the GPU
# (tools/gpu_trainer_matrix.py --cells issue51) on no engine and FSDP2, bf16 and fp32. Nothing is downloaded there.
#
#   bash tools/gpu_issue51.sh OUTDIR
set -u
out=${1:?usage: tools/gpu_issue51.sh OUTDIR}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
"$py" -m pip install -q --no-index --no-deps --no-compile --target /tmp/zf-common .whl/common/*.whl > "$out/install.txt" 2>&1
export PYTHONPATH=$PWD:/tmp/zf-common
{ nvidia-smi -L; "$py" -c 'import torch, sys; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
  "$py" -m pip list 2>/dev/null | grep -iE "^(transformers|accelerate|triton|torch) "; ls /tmp/zf-common; } > "$out/env.txt" 2>&1
start=$SECONDS
timeout "${BENCH_LIMIT:-180}" "$py" benchmarks/bench_chunked_ce.py --device cuda --repeats "${BENCH_REPEATS:-5}" \
  --json "$out/bench.json" > "$out/bench.txt" 2>&1
echo "bench: exit $? after $((SECONDS - start)) s" >> "$out/env.txt"
start=$SECONDS
timeout "${MATRIX_LIMIT:-240}" "$py" tools/gpu_trainer_matrix.py --cells issue51 --engines none,fsdp2 --nproc 1 \
  --dtypes bf16,fp32 --jobs 4 --json "$out/matrix-issue51.json" > "$out/matrix-issue51.txt" 2>&1
echo "matrix: exit $? after $((SECONDS - start)) s" >> "$out/env.txt"
exit 0
