#!/usr/bin/env bash
# Every GPU check in one call, for a machine with a CUDA device: builds zero_ext with its CUDA library
# (ZERO_EXT_CUDA=1: fail if nvcc/NCCL are missing), runs the tests marked `gpu`, then the GPU benchmark
# (benchmarks/bench_gpu.py: kernels vs torch and the copy floor; the engine at world 1 vs plain torch),
# and prints a short table. Usage: bash benchmarks/gpu_suite.sh
set -uo pipefail
cd "$(dirname "$0")/.."
# zero_ext's own NCCL transport and CUDA kernels on the engine's path (off by default until verified here)
export ZERO_EXT_CUDA_LIB=1
PY=${PYTHON:-python3}
start=$(date +%s)
ZERO_EXT_CUDA=1 "$PY" -m pip install --quiet --no-build-isolation --no-deps -e . || { echo "build failed"; exit 1; }
build_s=$(( $(date +%s) - start ))
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
"$PY" -m pytest -p no:cacheprovider -m gpu -q tests 2>&1 | tee /tmp/zero_ext_gpu_tests.log | tail -25
tests_rc=${PIPESTATUS[0]}
printf '\n%-28s %s\n' "check" "result"
printf '%-28s %ss\n' "build (ZERO_EXT_CUDA=1)" "$build_s"
printf '%-28s %s\n' "gpu tests" "$(grep -E '(passed|failed|error)' /tmp/zero_ext_gpu_tests.log | tail -1)"
echo
timeout 300 "$PY" benchmarks/bench_gpu.py ${BENCH_GPU_ARGS:-} 2>&1 | tee /tmp/zero_ext_gpu_bench.log | tail -20
bench_rc=${PIPESTATUS[0]}
printf '%-28s %s\n' "gpu benchmark" "exit $bench_rc (table above; log /tmp/zero_ext_gpu_bench.log)"
exit "$tests_rc"
