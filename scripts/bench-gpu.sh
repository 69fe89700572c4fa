#!/usr/bin/env bash
# make bench-gpu: the GPU benchmarks, each ending with its summary line
# (BENCH_ARGS=... goes to every one of them, e.g. BENCH_ARGS=--quick).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh
for bench in ${BENCHES:-gpu_transfer}; do
  python3 -m benchmarks.$bench ${BENCH_ARGS:-} 2>&1 | grep -v fork_posix | tee /tmp/bench-$bench.log
done
echo; grep -h '^summary:' /tmp/bench-*.log
