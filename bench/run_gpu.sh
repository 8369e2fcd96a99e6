#!/usr/bin/env bash
# Runs stages of the GPU benchmarks in order, each script under its own time limit, writing
# every result (JSON, markdown, a log per script) into $OUT; a failing script does not stop
# the rest. Stages: bench (= overhead recovery fidelity), kernelbench, soak, throughput,
# prebuilt, scale_out, gpumode_tasks, cpu.
#
#   OUT=/some/dir bench/run_gpu.sh overhead recovery
#   OUT=/some/dir bench/run_gpu.sh bench        # overhead, recovery, timing fidelity (~8 min)
#   OUT=/some/dir bench/run_gpu.sh kernelbench  # KernelBench level 1 + examples (~8 min)
#   OUT=/some/dir bench/run_gpu.sh kernelbench_self # each Model against itself, levels 1-3
#                                               # (EVERY=3: a third of each), vs do_bench
#   OUT=/some/dir bench/run_gpu.sh soak         # fault soak, 480 s (~9 min)
#   OUT=/some/dir bench/run_gpu.sh throughput   # 300 candidates via RunBatch per KINDS, with
#                                               # and without freezing (WPD per GPU; on a
#                                               # two-GPU machine it adds the two-GPU run)
#   OUT=/some/dir bench/run_gpu.sh prebuilt     # built ahead (no GPU) vs JIT, per kernel
#   OUT=/some/dir bench/run_gpu.sh builds       # load_inline builds: builder vs torch (~6 min)
#   OUT=/some/dir bench/run_gpu.sh kernelbench_run # level 1 through `kerneleval kernelbench`
#   OUT=/some/dir bench/run_gpu.sh build_service # load_inline jobs: build processes and the
#                                               # build cache vs in-job builds (~7 min)
#   OUT=/some/dir bench/run_gpu.sh rl_step      # one RL step: 64 KernelBench candidates, on
#                                               # every GPU of the machine (~5 min); with
#                                               # RL_CONFIGS='|--freeze-warming false' each
#                                               # set of flags in turn (STEPS each, default 2)
#   OUT=/some/dir bench/run_gpu.sh outside      # issue 40: level-1 problems against
#                                               # themselves and lying candidates, timed
#                                               # from outside their process (~4 min)
#   OUT=/some/dir bench/run_gpu.sh hygiene      # a launch process's cleanup between jobs
#                                               # (~2 min)
#   OUT=/some/dir bench/run_gpu.sh hardening    # the tamper defences on a job's warm path,
#                                               # armed vs never armed (~2 min)
#   OUT=/some/dir bench/run_gpu.sh judge        # compared jobs with and without the judge
#                                               # process (~3 min)
#   OUT=/some/dir bench/run_gpu.sh scale_out    # issue 18: a gateway and a node per GPU on one
#                                               # PostgreSQL (Debian's or the pgserver
#                                               # wheel's), KernelBench level 1 through the
#                                               # gateway, one node killed mid-run (~3 min)
#   OUT=/some/dir bench/run_gpu.sh gpumode_tasks # issue 43: every GPU MODE reference-kernels
#                                               # task folder this GPU can run (GPUMODE_TASKS,
#                                               # default .carry/reference-kernels/problems;
#                                               # GPUMODE_BUDGET_S, default 450; ~9 min)
#   OUT=/some/dir bench/run_gpu.sh restart      # issue 41: SIGTERM with 20 compared jobs in
#                                               # flight (drain, restart, every job recorded
#                                               # once), then load_inline builds before and
#                                               # after a restart on a warm state folder (~6 min)
#   OUT=/some/dir bench/run_gpu.sh cpu          # front end at scale (CPU only, ~1 min)
#
# Needs build/watchdog/kerneleval-watchdog (make watchdog) and the generated code under
# clients/python/src (make gen). KERNELBENCH (default ../shared/kernelbench) for kernelbench.
# Wheels in .whl (the service's packages the GPU image lacks) go to /opt/kerneleval-site: not
# under /tmp, which a job process's sandbox replaces with its own. As root it makes the job
# user, as `make` does. EXTRA_ARGS_<stage> adds arguments to a stage's script.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results}"
PY="${PYTHON:-python3}"
KERNELBENCH="${KERNELBENCH:-../shared/kernelbench}"
SITE=/opt/kerneleval-site
if [ -d .whl ] && [ ! -d "$SITE" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl
fi
[ -d "$SITE" ] && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH="$PWD/server:$PWD/clients/python/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ "$(id -u)" = 0 ] && ! id -u kerneleval-job >/dev/null 2>&1; then
  useradd --system --no-create-home --shell /usr/sbin/nologin kerneleval-job || true
fi
# Benchmarks measure runs: the same job sent again must run again, not come from the result
# cache (bench_result_cache.py measures the cache, on the CPU).
export KERNELEVAL_RESULT_CACHE_HOURS="${KERNELEVAL_RESULT_CACHE_HOURS:-0}"
mkdir -p "$OUT"
STATUS=0

# run LIMIT_S NAME ARGS...: SIGINT at the limit (the script stops its service), SIGKILL 20 s on.
run() {
  local limit="$1" name="$2"
  shift 2
  echo "=== $name (limit ${limit} s) $(date -u +%H:%M:%S)"
  local start=$SECONDS
  local extra="EXTRA_ARGS_$name"
  # shellcheck disable=SC2086 # word splitting of the extra arguments is wanted
  timeout -s INT -k 20 "$limit" "$PY" "bench/$name.py" --out "$OUT" "$@" ${!extra:-} 2>&1 \
    | tee "$OUT/$name${LOG_SUFFIX:-}.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$OUT/$name${LOG_SUFFIX:-}.log"
  [ "$rc" -eq 0 ] || STATUS=1
}

for STAGE in "$@"; do
case "$STAGE" in
  bench)  # overhead, recovery, timing fidelity
    run 420 bench_overhead
    run 180 bench_recovery --faults 10
    run 190 bench_timing_fidelity
    ;;
  overhead) run 420 bench_overhead ;;
  recovery) run 180 bench_recovery --faults 10 ;;
  fidelity) run 190 bench_timing_fidelity ;;
  kernelbench)
    # Jobs start for at most BUDGET_S; the eager baseline gets at most EAGER_BUDGET_S after.
    run $(( ${BUDGET_S:-300} + ${EAGER_BUDGET_S:-120} + 90 )) bench_kernelbench \
      --kernelbench "$KERNELBENCH" --budget-s "${BUDGET_S:-300}" \
      --eager-budget-s "${EAGER_BUDGET_S:-120}"
    ;;
  kernelbench_self)  # issues 40 and 41: each Model against itself, levels 1-3, vs do_bench
    run $(( ${BUDGET_S:-300} + ${EAGER_BUDGET_S:-180} + 90 )) bench_kernelbench \
      --kernelbench "$KERNELBENCH" --budget-s "${BUDGET_S:-300}" \
      --eager-budget-s "${EAGER_BUDGET_S:-180}" --compare-self $([ -n "${EXAMPLES:-}" ] || echo --no-examples) \
      --levels "${LEVELS:-1,2,3}" --every "${EVERY:-3}" --offset "${OFFSET:-0}" --trials "${TRIALS:-10}" \
      --workers-per-device "${WPD:-8}" --in-flight "${IN_FLIGHT:-8}" ${ONLY:+--only "$ONLY"}
    ;;
  soak)
    run $(( ${DURATION_S:-480} + 80 )) fault_soak --duration-s "${DURATION_S:-480}"
    ;;
  throughput)  # per kind (KINDS: io modelnew timed), frozen and not frozen during windows
    for KIND in ${KINDS:-io modelnew}; do
      LOG_SUFFIX=_$KIND run "${THROUGHPUT_LIMIT_S:-400}" bench_throughput --kind "$KIND" \
        --count "${COUNT:-300}" --baseline-count "${BASELINE_COUNT:-10}" \
        --workers-per-device "${WPD:-4}" --compare-unfrozen
    done
    ;;
  watchdog) run 150 gpu_watchdog_check ;;
  interference) run 400 bench_interference ;;
  prebuilt) run 240 gpu_prebuilt_check ;;
  builds) run 580 bench_builds ;;
  build_service) run 580 bench_build_service ;;
  kernelbench_run) run 580 bench_kernelbench_run ;;
  judge) run 400 bench_judge ;;
  rl_step)  # RL_CONFIGS: '|'-separated service flags, each run in turn (bench_rl_step.py)
    run 580 bench_rl_step --devices "$(nvidia-smi --query-gpu=index --format=csv,noheader \
      | paste -sd, -)" --steps "${STEPS:-2}" ${RL_CONFIGS:+--configs "$RL_CONFIGS"}
    ;;
  scale_out)  # needs two GPUs or more: a node on each
    run 560 gpu_scale_out --kernelbench "$KERNELBENCH" --devices "$(nvidia-smi \
      --query-gpu=index --format=csv,noheader | paste -sd, -)"
    ;;
  hygiene) run 120 gpu_launch_hygiene_check ;;
  outside) run 300 bench_outside_timing --budget-s "${BUDGET_S:-150}" ;;
  hardening) run 300 bench_hardening ;;
  gpumode_tasks)  # issue 43: GPU MODE task folders, cheapest first, within the budget
    run 580 bench_gpumode_tasks --tasks "${GPUMODE_TASKS:-.carry/reference-kernels/problems}" \
      --budget-s "${GPUMODE_BUDGET_S:-450}"
    ;;
  restart) run 420 bench_restart ;;
  cpu)
    run 300 bench_frontend_scale
    ;;
  *)
    echo "usage: OUT=DIR $0 STAGE... (bench overhead recovery fidelity kernelbench soak throughput watchdog interference prebuilt builds hygiene hardening judge scale_out gpumode_tasks restart cpu)" >&2
    exit 2
    ;;
esac
done
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader > "$OUT/gpus.txt" 2>&1
echo "stages $* done (status $STATUS); results in $OUT"
exit "$STATUS"
