#!/usr/bin/env bash
# The GPU test suite (the tests marked gpu or on_device: those that run on a GPU where there is
# one; CI runs every test on the CPU) with a header naming the device, versions, date, commit
# and source digest:
#   FLASH_MSA_COMMIT=<commit> LIMIT_S=<seconds> bash benchmarks/gpu_tests.sh LOG [pytest paths...]
# (default path: tests). Each failure is logged as it happens (pytest -v, passes left out);
# LIMIT_S interrupts the parallel run after that many seconds (0, the default: no limit) so
# that pytest still prints its summary. On one H100 the 292 gpu tests alone take 7 minutes at
# -n 8: give tests/ops and the other paths a call each.
set -uo pipefail
log=$1
shift
[ $# -gt 0 ] || set -- tests
on_gpu="gpu or on_device"
# The commit and source digest every benchmark record carries (FLASH_MSA_COMMIT, else git's
# HEAD, "+modified" where flash_msa differs from it: a copied tree's .git may be stale).
read -r commit digest < <(PYTHONPATH=benchmarks python3 -c \
  "from common import bench, source_digest; print(bench.source_commit(), source_digest())")
{
  python3 -c "import datetime, torch, triton; print(f'# GPU test run: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, {datetime.date.today()}')"
  echo "# commit $commit; flash_msa/**/*.py sha256 $digest"
  echo "# python3 -m pytest -v -n 8 -m '$on_gpu' $*, then the large_memory ones alone (PASSED lines left out)"
} >"$log"
failures() {  # the run's lines into the log, passes left out
  grep --line-buffered -v -E ' PASSED |^tests/.*::.* $' | tee -a "$log"
}
timeout --foreground -s INT "${LIMIT_S:-0}" python3 -m pytest -v -n 8 -rfE --durations=25 \
  -m "($on_gpu) and not large_memory" "$@" 2>&1 | failures
python3 -m pytest -v -n 0 -rfE -m "($on_gpu) and large_memory" "$@" 2>&1 | failures
