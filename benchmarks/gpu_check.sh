#!/usr/bin/env bash
# The prepared GPU check: on a machine with an NVIDIA GPU and jax's CUDA
# plugin installed, in at most 11.5 minutes (200 + 60 + 60 + 100 + 120 +
# 150 s),
#   1. the test suite without the 8-simulated-device tests, every result
#      written as it comes (gpu_check.log) and a junit XML at the end;
#   2. first-call cost, trace + lower against XLA compile (compile_time.py);
#   3. the factors' refresh by eigh against the subspace solver, and
#      Householder QR against CholeskyQR2 (decomposition_time.py);
#   4. the step-time table against SGD and AdamW, eigh against the subspace
#      solver and EKFAC (step_time.py);
#   5. K-FAC's phases and levers beside AdamW's step on three race
#      workloads (phases.py, wall clock: the CPU clock does not see the GPU);
#   6. a short race, AdamW against K-FAC, on the wide transformer and the
#      BatchNorm CNN (convergence.py).
# Each part has its own time limit, so a hang costs that part only.
#
#   bash benchmarks/gpu_check.sh OUT_DIR            # run from the repo root
#   PYTHON=/path/to/python bash benchmarks/gpu_check.sh OUT_DIR
#   TESTS=tests/test_finite.py bash benchmarks/gpu_check.sh OUT_DIR  # fewer tests
#
# The package runs from the checkout (PYTHONPATH), with the machine's jax,
# flax and optax: nothing is installed. OUT_DIR receives five files:
# gpu_check.log (everything printed, the compile table included), junit.xml,
# step_time.md, phases.md and race.md.
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu_check.sh OUT_DIR}
python=${PYTHON:-python3}
tests=${TESTS:-tests}
cd "$(dirname "$0")/.."
mkdir -p "$out"
out=$(cd "$out" && pwd)
scratch=$(mktemp -d)
log="$out/gpu_check.log"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Several processes share the GPU: none may take 75 % of its memory up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
status=0

# part NAME SECONDS COMMAND...: runs COMMAND under its limit, logged as it goes.
part() {
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit} s): $*" | tee -a "$log"
  local start=$SECONDS
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$log"
  [ "$rc" -eq 0 ] || status=1
}

"$python" -c "import jax, flax, optax, sys; print(sys.version.split()[0], \
'jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, \
jax.devices())" 2>&1 | tee -a "$log"
git log -1 --format='commit %h %s' 2>/dev/null | tee -a "$log"

# Simulated CPU meshes and local processes are CPU tests: CI runs them.
part tests 200 "$python" -m pytest $tests \
  -m "not multidevice and not multiprocess" -n 12 -v \
  -p no:cacheprovider --timeout 120 -o addopts="-ra" \
  --junitxml="$out/junit.xml"
part compile_time 60 "$python" -m benchmarks.compile_time --no-progress \
  --variants adamw kfac-eigen kfac-adaptive --repeats 1 --out "$scratch/ct"
part decomposition_time 60 "$python" -m benchmarks.decomposition_time \
  --no-progress --repeats 5 --out "$scratch/dt"
part step_time 100 "$python" -m benchmarks.step_time --no-progress \
  --models autoencoder --batch-sizes 256 --rounds 3 \
  --variants sgd adamw kfac-eigen kfac-inverse kfac-eigen-subspace \
  kfac-eigen-ekfac --out "$scratch/st"
part phases 120 "$python" -m benchmarks.phases --no-progress \
  --tasks shakespeare_wide resnet20 mnist_bn --rounds 5 --statistic min \
  --out "$scratch/ph"
part race 150 "$python" -m benchmarks.convergence --no-progress \
  --tasks shakespeare_wide mnist_bn --optimizers adamw kfac --no-sweep \
  --seeds 0 --budget 15 --eval-examples 2000 --out "$scratch/race"

# The tables, one file per part (the JSON records stay in $scratch).
for pair in st:step_time ph:phases race:race; do
  found=$(ls "$scratch/${pair%%:*}"/*.md 2>/dev/null | head -1)
  [ -n "$found" ] && cp "$found" "$out/${pair#*:}.md"
done
echo "=== gpu_check: exit $status" | tee -a "$log"
exit $status
