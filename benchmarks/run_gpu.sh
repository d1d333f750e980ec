#!/usr/bin/env bash
# The GPU runs, from any directory, on a machine with a CUDA GPU and a CUDA build of torch:
#
#   bash benchmarks/run_gpu.sh tests   # the whole suite with --device cuda (tests/test_cuda.py included)
#   bash benchmarks/run_gpu.sh cuda    # tests/test_cuda.py alone
#   bash benchmarks/run_gpu.sh bench   # benchmarks/run.py --device cuda -> benchmarks/results/cuda-*.json
#   bash benchmarks/run_gpu.sh         # tests, then bench
#
# PYTHON picks the interpreter (default python3). Without tensordict installed, wheels in .whl/
# (see benchmarks/RESULTS.md, "GPU: how to run") are installed to /tmp/site first. Logs go to
# $OUT (else /tmp), and the benchmark's JSON is copied there too. Exits non-zero if a step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stage=${1:-all}
logs=${OUT:-/tmp}
case $stage in all | tests | cuda | bench) ;; *) echo "unknown stage $stage: tests, cuda, bench or all" >&2; exit 2 ;; esac
export PYTHONUNBUFFERED=1

if ! "$PY" -c "import tensordict" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
"$PY" - <<'EOF' || exit 1
import tensordict, torch
assert torch.cuda.is_available(), "torch sees no CUDA device"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), tensordict {tensordict.__version__}, "
      f"{torch.cuda.get_device_name()}")
EOF

failed=0
run() {  # run NAME COMMAND...: the command's output to the terminal and to $logs/NAME.log
    echo "== $1: ${*:2}"
    "${@:2}" 2>&1 | tee "$logs/$1.log"
    local rc=${PIPESTATUS[0]}
    echo "== $1: exit $rc"
    [[ $rc == 0 ]] || failed=1
}

if [[ $stage == all || $stage == tests ]]; then
    run pytest-cuda "$PY" -m pytest -q -rs -p no:cacheprovider --device cuda
fi
if [[ $stage == cuda ]]; then
    run test-cuda "$PY" -m pytest -q -rs -p no:cacheprovider --device cuda tests/test_cuda.py
fi
if [[ $stage == all || $stage == bench ]]; then
    json="benchmarks/results/cuda-$(date +%Y%m%d-%H%M%S).json"
    run bench-cuda "$PY" benchmarks/run.py --device cuda --out "$json"
    [[ -f $json && -n ${OUT:-} ]] && cp "$json" "$OUT/"
fi
exit $failed
