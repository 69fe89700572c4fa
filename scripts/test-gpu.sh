#!/usr/bin/env bash
# make test-gpu: the GPU tests (kernels, copy engines, CUDA IPC workers, async loads) and then the
# whole suite, on a machine with a GPU. Prints a short table last.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh
python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=300 tests/gpu tests/tiercache/test_kernels.py tests/tiercache/test_copy_engines.py -rA 2>&1 | tail -25
gpu=${PIPESTATUS[0]}
python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=300 tests --ignore=tests/gpu 2>&1 | tail -3
all=${PIPESTATUS[0]}
printf '\n%-28s %s\n%-28s %s\n' "GPU tests" "$([ $gpu = 0 ] && echo passed || echo FAILED)" \
  "the rest of the suite here" "$([ $all = 0 ] && echo passed || echo FAILED)"
[ $gpu = 0 ] && [ $all = 0 ]
