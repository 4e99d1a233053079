#!/usr/bin/env bash
# The GPU checks in one run, for when a CUDA device is lent (one call of about 8 minutes):
#   tests    pytest -m gpu, over the test files that hold GPU-marked tests
#   kernels  benchmarks/kernel_bench.py: decode-attention bandwidth against copy bandwidth
#   e2e      benchmarks/gpu/e2e.py: bf16 throughput, ringserve against transformers
# Each stage runs under its own time limit and writes its log into one folder; a failed
# stage does not stop the next. The summary goes to stdout and to summary.txt there.
#
# Usage: benchmarks/gpu_check.sh [--out DIR] [--stages tests,kernels,e2e] [--model DIR]
#   --out DIR     results folder (default: $OUT if set, else benchmarks/results/gpu/)
#   --stages LIST comma-separated subset of tests,kernels,e2e (default: all three)
#   --model DIR   model for e2e, e.g. a converted gemma-3-270m folder (also
#                 $RINGSERVE_GPU_MODEL); default: the gemma-3-270m preset when its package
#                 is installed, else a synthetic Mistral-style model built on the spot
# Environment: PYTHON (default python3); GPU_CHECK_TIMEOUT_TESTS / _KERNELS / _E2E in
#   seconds (defaults 120 / 100 / 220: about 7.5 minutes in all). Nothing is downloaded:
#   the project is installed with `pip install -e . --no-deps` only when `import ringserve.engine`
#   fails.
# Exit status: 0 when every stage passed or was skipped (no CUDA device: every stage is
#   skipped at once), 1 when a stage failed or timed out, 2 for bad arguments.
set -uo pipefail

STAGES=(tests kernels e2e)
declare -A LIMIT=([tests]=120 [kernels]=100 [e2e]=220)

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "gpu_check: $*" >&2; exit 2; }

out=${OUT:-}
stages=$(IFS=,; echo "${STAGES[*]}")
while (($#)); do
  case $1 in
    --out | --stages | --model) [[ $# -ge 2 && -n $2 ]] || die "$1 needs a value (see --help)" ;;&
    --out) out=$2; shift 2 ;;
    --stages) stages=$2; shift 2 ;;
    --model) export RINGSERVE_GPU_MODEL=$2; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
IFS=, read -ra selected <<<"$stages"
for s in "${selected[@]}"; do
  [[ " ${STAGES[*]} " == *" $s "* ]] || die "unknown stage '$s' (stages: ${STAGES[*]})"
done

root=$(cd "$(dirname "$0")/.." && pwd)
out=$(realpath -m "${out:-$root/benchmarks/results/gpu}")
mkdir -p "$out" || die "cannot create $out"
cd "$root" || exit 2
PY=${PYTHON:-python3}
summary=$out/summary.txt
: >"$summary"
failed=0

report() {  # stage, status, seconds
  printf '%-8s %-34s %5ss\n' "$1" "$2" "$3" >>"$summary"
}

preflight() {  # what the machine has, into env.txt; make `import ringserve.engine` work
  {
    date -u; git rev-parse HEAD 2>/dev/null; git status --short 2>/dev/null | head -20
    command -v nvidia-smi >/dev/null && nvidia-smi
    "$PY" - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0])
for name in ("torch", "triton", "transformers", "pytest", "hypothesis", "yaml", "safetensors"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except ImportError as err:
        print(name, "MISSING:", err)
EOF
  } >"$out/env.txt" 2>&1
  if ! (cd / && "$PY" -c 'import ringserve.engine, ringserve.kernels') >>"$out/env.txt" 2>&1; then
    echo "import ringserve.engine failed: pip install -e . --no-deps" | tee -a "$out/env.txt"
    "$PY" -m pip install -q -e . --no-deps --no-build-isolation >>"$out/env.txt" 2>&1 \
      || export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
  fi
}

stage_command() {  # the command line of a stage, one word a line
  case $1 in
    tests)
      printf '%s\n' "$PY" -m pytest -m gpu -q -p no:cacheprovider --junitxml "$out/tests.xml"
      grep -l 'pytest.mark.gpu' tests/test_*.py ;;
    kernels) printf '%s\n' "$PY" benchmarks/kernel_bench.py ;;
    e2e) printf '%s\n' "$PY" benchmarks/gpu/e2e.py --json "$out/e2e.json" ;;
  esac
}

probe=$("$PY" -c 'import torch; print(torch.cuda.is_available())' 2>/dev/null) || probe="no torch"
if [[ $probe != True ]]; then
  # NOTE: a GPU that nvidia-smi sees but this python's torch does not (a CPU build, or no
  # torch) is a broken set-up, not a machine without a GPU: fail rather than skip.
  if [[ ${CUDA_VISIBLE_DEVICES-unset} != "" ]] && nvidia-smi -L >/dev/null 2>&1; then
    for s in "${selected[@]}"; do report "$s" "failed: torch sees no GPU" 0; done
    echo "gpu_check: nvidia-smi lists a GPU, but $PY's torch does not ($probe); set PYTHON" >&2
    cat "$summary"
    exit 1
  fi
  for s in "${selected[@]}"; do
    echo "$s: no CUDA device: skipping"
    report "$s" "skipped (no CUDA device)" 0
  done
else
  preflight
  for s in "${selected[@]}"; do
    var=GPU_CHECK_TIMEOUT_${s^^}
    limit=${!var:-${LIMIT[$s]}}
    mapfile -t cmd < <(stage_command "$s")
    echo "== $s (limit ${limit}s): ${cmd[*]}"
    start=$SECONDS
    timeout --kill-after=10 "$limit" "${cmd[@]}" 2>&1 | tee "$out/$s.log"
    rc=${PIPESTATUS[0]}
    case $rc in
      0) status=passed ;;
      124 | 137) status="failed: timed out after ${limit}s"; failed=1 ;;
      *) status="failed: exit $rc"; failed=1 ;;
    esac
    report "$s" "$status" $((SECONDS - start))
  done
fi

echo "== summary ($out)"
cat "$summary"
exit "$failed"
