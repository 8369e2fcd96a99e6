#!/usr/bin/env bash
# The GPU checks of issues 3-6 in one device call: engine cases and timing against do_bench,
# the watchdog's real NVML path, the clients (doctor on a GPU), and a short service soak.
# Expects the carried paths (see bench/README.md): generated code, the watchdog binary,
# wheels in .whl, KernelBench in .carry/kernelbench. Everything lands in $OUT/checks.tar.gz.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results}"
R=/tmp/kerneleval-checks
mkdir -p "$R" "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="server:clients/python/src:$PYTHONPATH" PYTHONUNBUFFERED=1
step() {  # step LIMIT_S NAME COMMAND...
  local limit="$1" name="$2"; shift 2
  echo "=== $name $(date -u +%T)"
  timeout -s INT -k 15 "$limit" "$@" > "$R/$name.log" 2>&1
  echo "=== $name exit $? ($(date -u +%T))"; tail -n "${TAIL:-25}" "$R/$name.log"
}
step 300 engine python3 bench/gpu_engine_check.py --kernelbench .carry/kernelbench --out "$R"
step 120 watchdog python3 bench/gpu_watchdog_check.py --out "$R"
[ "${SOAK_S:-90}" -gt 0 ] && step 150 service_soak python3 bench/gpu_service_soak.py --duration "${SOAK_S:-90}" --out "$R"
KERNELBENCH_DIR=.carry/kernelbench step 120 clients python3 tests/clients/gpu_clients_check.py --out "$R/clients"
tar -czf "$OUT/checks.tar.gz" -C "$R" .
