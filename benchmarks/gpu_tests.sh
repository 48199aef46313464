#!/usr/bin/env bash
# The GPU test suite with a header naming the device, versions, date and source digest:
#   bash benchmarks/gpu_tests.sh LOG [pytest paths...]   (default: tests/ops tests/msa)
set -uo pipefail
log=$1
shift
paths=("${@:-tests/ops tests/msa}")
{
  python3 -c "import datetime, torch, triton; print(f'# GPU test run: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, {datetime.date.today()}')"
  # The sources' digest, not a commit: a copied working tree may carry a stale .git.
  digest=$(find flash_msa -name '*.py' | sort | xargs cat | sha256sum | cut -c1-12)
  echo "# flash_msa/*.py sha256 $digest; python3 -m pytest -q -n 8 ${paths[*]}, then the"
  echo "# large_memory tests alone"
} >"$log"
# shellcheck disable=SC2068
python3 -m pytest -q -n 8 -rfE -m "not large_memory" ${paths[@]} 2>&1 | tee -a "$log"
# shellcheck disable=SC2068
python3 -m pytest -q -rfE -m large_memory ${paths[@]} 2>&1 | tee -a "$log"
