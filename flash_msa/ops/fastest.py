"""Timing a call on its device, and interchangeable code paths chosen by that timing once per
key, as triton.autotune chooses between the configs of one kernel (the gluon backward's dQ
modes under deterministic=False: flash_msa/ops/gluon/__init__.py says why neither always
wins)."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import TypeVar

import torch

Result = TypeVar("Result")


def elapsed_ms(run: Callable[[], Result], device: torch.device) -> tuple[float, Result]:
    """Wall milliseconds of one call of run, synchronised before and after on a CUDA device,
    and its result."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 1e3 * (time.perf_counter() - start), result


class FastestPath:
    """Runs, for a key not seen before, each path twice (the first call compiles and
    autotunes its kernels; the second is timed) and from then on only the fastest. Each
    call's result comes from one run of one path: the last timed run on the first call,
    whose earlier results are dropped before the next path runs, so at most one result is
    alive at a time. While a CUDA graph is being captured nothing is timed: the first path
    runs."""

    def __init__(self, paths: tuple[str, ...]):
        self.paths = paths
        self.timings: dict[Hashable, dict[str, float]] = {}  # key -> {path: ms}
        self.chosen: dict[Hashable, str] = {}

    def __call__(self, key: Hashable, run: Callable[[str], Result], device: torch.device) -> Result:
        if key in self.chosen:
            return run(self.chosen[key])
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return run(self.paths[0])
        times = {}
        result = None
        for candidate in self.paths:
            result = None
            run(candidate)
            times[candidate], result = elapsed_ms(lambda name=candidate: run(name), device)
        self.timings[key] = times
        self.chosen[key] = min(times, key=times.get)
        return result
