#!/usr/bin/env bash
# The checks a machine with a GPU is for, in one go: the `cuda`-marked tests, then the GPU
# benchmarks (GPT-style training tokens/s and MFU, prefetching to the device). Each part has a
# time limit of its own so one that hangs leaves the others their time; every log is written
# under $OUT (default ./gpu-logs) as well as printed.
#
#   bash benchmarks/gpu_checks.sh                  # the project's own environment
#   PYTHON=python3 bash benchmarks/gpu_checks.sh   # a machine's own torch: runs from src/
set -uo pipefail
out=${OUT:-gpu-logs}
mkdir -p "$out"
py=${PYTHON:-python}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

{
    nvidia-smi -L
    "$py" -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.version.cuda, torch.cuda.device_count(), 'GPU(s):', \
[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])"
} 2>&1 | tee "$out/env.log"

# Only the files that hold cuda-marked tests: collecting the whole suite imports test-only
# packages (a browser driver, the docs generator) a GPU machine may not have.
timeout "${TESTS_S:-300}" "$py" -m pytest -m cuda -q -p no:cacheprovider -o addopts=-ra \
    tests/test_cuda_paths.py tests/test_device_placement.py tests/test_mixed_precision.py \
    tests/test_parallel_branches.py tests/test_prefetch.py tests/test_benchmarks.py \
    2>&1 | tee "$out/cuda_tests.log"
echo "cuda tests: exit ${PIPESTATUS[0]}" | tee -a "$out/cuda_tests.log"

timeout "${TRAINING_S:-240}" "$py" benchmarks/gpu_training.py --json "$out/gpu_training.json" \
    2>&1 | tee "$out/gpu_training.log"
echo "gpu_training: exit ${PIPESTATUS[0]}" | tee -a "$out/gpu_training.log"

timeout "${PREFETCH_S:-90}" "$py" benchmarks/prefetch.py --device cuda \
    --json "$out/prefetch.json" 2>&1 | tee "$out/prefetch.log"
echo "prefetch: exit ${PIPESTATUS[0]}" | tee -a "$out/prefetch.log"
