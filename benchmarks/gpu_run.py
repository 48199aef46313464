"""Where a GPU benchmark writes and what it records about the run."""

from __future__ import annotations

import datetime
import json
import pathlib

import torch
import triton


def run_metadata(device: torch.device) -> dict:
    """The device's name and memory, torch and triton versions, and today's date."""
    return dict(
        device=torch.cuda.get_device_name(device),
        memory_gib=round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1),
        torch=torch.__version__,
        triton=triton.__version__,
        date=datetime.date.today().isoformat(),
    )


def results_dir(out: str | None, meta: dict) -> pathlib.Path:
    """out, or benchmarks/results/<gpu>/ (e.g. h200), created if missing."""
    folder = meta["device"].split()[-1].lower()
    path = pathlib.Path(out or pathlib.Path(__file__).parent / "results" / folder)
    path.mkdir(parents=True, exist_ok=True)
    return path


def kept_records(path: pathlib.Path, field: str, measured) -> list[dict]:
    """The records (a JSON list at path, if any) whose `field` is not among those this run
    measures: a run of some cases or lengths keeps the earlier figures of the others."""
    earlier = json.loads(path.read_text()) if path.exists() else []
    return [record for record in earlier if record[field] not in measured]
