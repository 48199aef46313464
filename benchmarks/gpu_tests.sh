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
# FLASH_MSA_COMMIT, else git's HEAD, "+modified" where flash_msa differs from it (a copied
# tree's .git may be stale), as every benchmark record names it
commit=$(python3 -c "from flash_msa.bench import source_commit; print(source_commit())")
# The digest too: benchmarks/common.py records the same with every benchmark result.
digest=$(find flash_msa -name '*.py' | LC_ALL=C sort | xargs cat | sha256sum | cut -c1-12)
{
  python3 -c "import datetime, torch, triton; print(f'# GPU test run: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, {datetime.date.today()}')"
  echo "# commit $commit; flash_msa/**/*.py sha256 $digest"
  echo "# python3 -m pytest -v -n 8 -m 'gpu or on_device' $*, then the large_memory ones alone (PASSED lines left out)"
} >"$log"
timeout --foreground -s INT "${LIMIT_S:-0}" \
  python3 -m pytest -v -n 8 -rfE --durations=25 -m "(gpu or on_device) and not large_memory" "$@" 2>&1 \
  | grep --line-buffered -v -E ' PASSED |^tests/.*::.* $' | tee -a "$log"
python3 -m pytest -v -n 0 -rfE -m "gpu and large_memory" "$@" 2>&1 | grep --line-buffered -v -E ' PASSED |^tests/.*::.* $' | tee -a "$log"
