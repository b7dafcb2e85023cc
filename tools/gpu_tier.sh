#!/usr/bin/env bash
# The GPU tier in one call on a GPU machine (docs/benchmarks.md, "GPU"): the chunked-CE table alone on the GPU, then
# at once the gpu-marked parity tests and tools/gpu_trainer_matrix.py on the machine's transformers and on each
# carried stack.
#
#   bash tools/gpu_tier.sh OUTDIR [STACK_WHEELS_DIR ...]
#
# Nothing is downloaded there. Optional wheel folders (pip download --no-deps --only-binary=:all: for the machine's
# Python): .whl/common (DeepSpeed, its pydantic/hjson, liger-kernel, cut-cross-entropy), and one folder per extra
# stack holding its transformers / accelerate / tokenizers (/ huggingface_hub). Each stage has its own time limit, so
# what finished comes back. Writes OUTDIR/*.txt and *.json; exits 0 (the tables carry the verdicts).
set -u
out=${1:?usage: tools/gpu_tier.sh OUTDIR [STACK_WHEELS_DIR ...]}
shift
mkdir -p "$out"
py=${PYTHON:-python3}
install() {  # wheels -> a target folder of their own (no resolver, no network)
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$2" "$1"/*.whl
}
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
base=$PWD
if [ -d .whl/common ]; then install .whl/common /tmp/zf-common && base=$PWD:/tmp/zf-common; fi
export PYTHONPATH=$base
{ nvidia-smi -L; "$py" -c 'import torch, sys; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
  "$py" -m pip list 2>/dev/null | grep -iE "^(transformers|accelerate|deepspeed|liger|cut.cross|triton|torch) "; } > "$out/env.txt" 2>&1
"$py" -c 'import torch; from zerofix import losses
print("in-place bf16 accumulation (torch.addmm out_dtype, out=acc) adds right:",
      losses.gemm.addmm_adds_in_place(torch.device("cuda"), torch.bfloat16))' >> "$out/env.txt" 2>&1
start=$SECONDS
# 1. Timings first, with the GPU to themselves: zerofix's chunk sizes, then the table against the other kernels
timeout "${SWEEP_LIMIT:-120}" "$py" benchmarks/bench_chunked_ce.py --device cuda --sweep --json "$out/sweep.json" \
  > "$out/sweep.txt" 2>&1
echo "sweep: exit $? after $((SECONDS - start)) s" >> "$out/env.txt"
start=$SECONDS
timeout "${BENCH_LIMIT:-200}" "$py" benchmarks/bench_chunked_ce.py --device cuda --repeats "${BENCH_REPEATS:-5}" \
  --json "$out/bench.json" > "$out/bench.txt" 2>&1
echo "bench: exit $? after $((SECONDS - start)) s" >> "$out/env.txt"
# 2. Correctness, all at once (each Trainer run is a tiny model: the GPU holds dozens)
start=$SECONDS
timeout "${TEST_LIMIT:-300}" "$py" -m pytest -m gpu tests/test_gpu.py -k "chunked or kernel or table" -q -p no:cacheprovider \
  > "$out/pytest.txt" 2>&1 &
timeout "${MATRIX_LIMIT:-300}" "$py" tools/gpu_trainer_matrix.py --jobs "${JOBS:-5}" --dtypes "${DTYPES:-bf16,fp16}" \
  --json "$out/matrix-machine.json" \
  > "$out/matrix-machine.txt" 2>&1 &
for wheels in "$@"; do
  name=$(basename "$wheels")
  (install "$wheels" "/tmp/zf-$name" && PYTHONPATH=$PWD:/tmp/zf-$name:/tmp/zf-common timeout "${MATRIX_LIMIT:-300}" \
     "$py" tools/gpu_trainer_matrix.py --jobs "${JOBS:-5}" --dtypes "${DTYPES:-bf16,fp16}" \
     --json "$out/matrix-$name.json") > "$out/matrix-$name.txt" 2>&1 &
done
wait
echo "tests and matrices: $((SECONDS - start)) s" >> "$out/env.txt"
exit 0
