#!/usr/bin/env bash
# make bench-gpu: the GPU benchmarks, each ending with its summary line
# (BENCH_ARGS=... goes to every one of them, e.g. BENCH_ARGS=--quick). With $OUT set, each
# benchmark's output also goes to $OUT/bench-NAME.log (and shared_prefix writes its tables
# per model there).
#   make bench-gpu BENCHES=shared_prefix BENCH_ARGS="--full --groups 10 --profile"
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh
logs=${OUT:-/tmp}
mkdir -p "$logs"
for bench in ${BENCHES:-gpu_transfer checkpoint_copy}; do
  python3 -m benchmarks.$bench ${BENCH_ARGS:-} 2>&1 | grep -v fork_posix | tee "$logs/bench-$bench.log"
done
echo; for bench in ${BENCHES:-gpu_transfer checkpoint_copy}; do grep -h '^summary:' "$logs/bench-$bench.log"; done
