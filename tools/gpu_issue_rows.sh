#!/usr/bin/env bash
# One device call for an issue's GPU rows (docs/measured/gpu-*-<date>-issueNN): the chunked-CE table against
# Liger-Kernel and cut-cross-entropy (their defaults; carried as wheels in .whl/common) with the GPU to itself, then at
# once the issue's Trainer rows (tools/gpu_trainer_matrix.py --cells CELLS) on no engine and FSDP2, bf16 and fp32, and,
# given a -k expression, the gpu-marked tests it selects. Nothing is downloaded there.
#
#   bash tools/gpu_issue_rows.sh OUTDIR CELLS [PYTEST_K]
set -u
out=${1:?usage: tools/gpu_issue_rows.sh OUTDIR CELLS [PYTEST_K]}
cells=${2:?usage: tools/gpu_issue_rows.sh OUTDIR CELLS [PYTEST_K]}
tests=${3:-}
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
if [ -n "$tests" ]; then
  timeout "${TEST_LIMIT:-150}" "$py" -m pytest -m gpu tests/test_gpu.py -k "$tests" -q -p no:cacheprovider \
    > "$out/pytest.txt" 2>&1 &
fi
timeout "${MATRIX_LIMIT:-240}" "$py" tools/gpu_trainer_matrix.py --cells "$cells" --engines none,fsdp2 --nproc 1 \
  --dtypes bf16,fp32 --jobs 4 --json "$out/matrix-$cells.json" > "$out/matrix-$cells.txt" 2>&1 &
wait
echo "tests and matrix: $((SECONDS - start)) s" >> "$out/env.txt"
exit 0
