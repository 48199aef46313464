"""Interchangeable code paths chosen by timing, once per key, as triton.autotune chooses
between the configs of one kernel.

The gluon backward with deterministic=False has two ways to the same gradients: dQ added
into an fp32 buffer inside the dK / dV kernel (fewer matmuls), or the separate dQ kernel
(no read-modify-write of that buffer). Which is faster depends on where a layout's blocks
lie, not only on the shapes: adds from neighbouring blocks meet in the L2, scattered ones
go to memory. So the first call of each key runs every path and keeps the fastest.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import TypeVar

import torch

Result = TypeVar("Result")


def elapsed_ms(run: Callable[[], Result], device: torch.device) -> tuple[float, Result]:
    """Milliseconds one call of run takes on the device (CUDA events, else the host's clock
    around it) and its result."""
    if device.type != "cuda":
        start = time.perf_counter()
        result = run()
        return (time.perf_counter() - start) * 1e3, result
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    result = run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end), result


class FastestPath:
    """Runs, for a key not seen before, each path twice (the first call compiles and
    autotunes its kernels; the second is timed) and from then on only the fastest. Each
    call's result comes from one run of one path: the last timed run on the first call,
    whose earlier results are dropped before the next path runs, so at most one result is
    alive at a time. While a CUDA graph is being captured nothing is timed: the path
    chosen before, else the first, runs."""

    def __init__(self, paths: tuple[str, ...]):
        self.paths = paths
        self.timings: dict[Hashable, dict[str, float]] = {}  # key -> {path: ms}
        self.chosen: dict[Hashable, str] = {}

    def __call__(self, key: Hashable, run: Callable[[str], Result], device: torch.device) -> Result:
        path = self.chosen.get(key)
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if path is not None or capturing:
            return run(path or self.paths[0])
        times = {}
        result = None
        for candidate in self.paths:
            result = None
            run(candidate)
            times[candidate], result = elapsed_ms(lambda name=candidate: run(name), device)
        self.timings[key] = times
        self.chosen[key] = min(times, key=times.get)
        return result
