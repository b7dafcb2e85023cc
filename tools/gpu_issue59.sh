#!/usr/bin/env bash
# One device call for issue 59 (docs/measured/gpu-*-<date>-issue59): the own-mean heads' step memory and time
# (benchmarks/bench_own_mean_heads.py --device cuda, bf16, upstream against zerofix.patch(), alone on the GPU) after
# the gpu-marked proof test at a real head's size and issue 59's Trainer rows (tools/gpu_trainer_matrix.py --cells
# issue59) on no engine and FSDP2, bf16 and fp32, those two at once. Nothing is downloaded there.
#
#   bash tools/gpu_issue59.sh OUTDIR
set -u
out=${1:?usage: tools/gpu_issue59.sh OUTDIR}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore PYTHONPATH=$PWD
{ nvidia-smi -L; "$py" -c 'import torch, sys; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
  "$py" -m pip list 2>/dev/null | grep -iE "^(transformers|accelerate|torch) "; } > "$out/env.txt" 2>&1
start=$SECONDS
timeout "${TEST_LIMIT:-150}" "$py" -m pytest -m gpu tests/test_gpu.py -k "inline_mean" -q -p no:cacheprovider \
  > "$out/pytest.txt" 2>&1 &
timeout "${MATRIX_LIMIT:-150}" "$py" tools/gpu_trainer_matrix.py --cells issue59 --engines none,fsdp2 --nproc 1 \
  --dtypes bf16,fp32 --jobs 4 --json "$out/matrix-issue59.json" > "$out/matrix-issue59.txt" 2>&1 &
wait
echo "tests and matrix: $((SECONDS - start)) s" >> "$out/env.txt"
start=$SECONDS  # the benchmark alone on the GPU: its times are not shared with the runs above
(cd benchmarks && timeout "${BENCH_LIMIT:-150}" "$py" bench_own_mean_heads.py --device cuda --seq 4096 --vocab 128000 \
  --repeats "${BENCH_REPEATS:-2}" --json "$out/bench.json" > "$out/bench.txt" 2>&1; echo "bench: exit $?" >> "$out/env.txt")
echo "all: $((SECONDS - start)) s" >> "$out/env.txt"
exit 0
