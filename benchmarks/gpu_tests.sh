#!/usr/bin/env bash
# The GPU test suite with a header naming the device, versions, date and commit:
#   bash benchmarks/gpu_tests.sh LOG [pytest paths...]   (default: tests/ops tests/msa)
set -uo pipefail
log=$1
shift
paths=("${@:-tests/ops tests/msa}")
{
  python3 -c "import datetime, torch, triton; print(f'# GPU test run: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, {datetime.date.today()}')"
  echo "# commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown); python3 -m pytest -q -n 8 ${paths[*]}"
} >"$log"
# shellcheck disable=SC2068
python3 -m pytest -q -n 8 -rfE ${paths[@]} 2>&1 | tee -a "$log"
