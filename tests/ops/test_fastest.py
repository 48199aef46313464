"""FastestPath: interchangeable code paths timed once per key, the fastest kept."""

import time
import weakref

import pytest
import torch

from flash_msa.ops.fastest import FastestPath, elapsed_ms

CPU = torch.device("cpu")


class Result:
    """A stand-in for a call's output tensors, counted while alive."""

    alive = 0

    def __init__(self, path):
        self.path = path
        Result.alive += 1
        weakref.finalize(self, Result.dead)

    @staticmethod
    def dead():
        Result.alive -= 1


def paths_taking(delays: dict[str, float], calls: list):
    """run(path): records the path and how many results were alive when it began, sleeps
    the path's delay and returns a new result."""

    def run(path):
        calls.append((path, Result.alive))
        time.sleep(delays[path])
        return Result(path)

    return run


def test_first_call_times_each_path_then_only_the_fastest_runs():
    calls = []
    run = paths_taking({"slow": 0.03, "fast": 0.0, "slower": 0.06}, calls)
    fastest = FastestPath(("slow", "fast", "slower"))
    first = fastest("key", run, CPU)
    # Each path twice (compile, then timed), no earlier result alive when a run begins.
    assert calls == [(path, 0) for path in ("slow", "slow", "fast", "fast", "slower", "slower")]
    assert first.path == "slower"  # the last timed run's result
    assert fastest.chosen == {"key": "fast"}
    assert fastest.timings["key"]["fast"] < fastest.timings["key"]["slow"]
    del first
    calls.clear()
    assert [fastest("key", run, CPU).path for _ in range(3)] == ["fast"] * 3
    assert [path for path, _ in calls] == ["fast"] * 3


def test_each_key_is_timed_on_its_own():
    calls = []
    delays = {"a": 0.0, "b": 0.03}
    fastest = FastestPath(("a", "b"))
    fastest(1, paths_taking(delays, calls), CPU)
    delays.update(a=0.03, b=0.0)
    fastest(2, paths_taking(delays, calls), CPU)
    assert fastest.chosen == {1: "a", 2: "b"}
    assert len(calls) == 8


def test_elapsed_ms_on_the_cpu():
    ms, value = elapsed_ms(lambda: time.sleep(0.02) or 7, CPU)
    assert value == 7 and 20 <= ms < 1000


@pytest.mark.gpu
def test_elapsed_ms_synchronises_cuda():
    a = torch.randn(2048, 2048, device="cuda")
    ms, product = elapsed_ms(lambda: a @ a, a.device)
    assert product.shape == (2048, 2048) and 0 < ms < 1000
