"""Where one MSA training step (bench_msa's: msa_func forward + backward, local proxies) spends
its GPU time: torch.profiler's table of two steps, ops and kernels by CUDA time; with
--memory, where its peak memory goes instead: the allocations the step made that are alive
at its peak, summed by their flash_msa call site (the rest of the peak is what the caller
holds: the inputs and dout); with --syncs, where the host holds the GPU up: each call that
synchronises with the device (torch.cuda.set_sync_debug_mode) and its flash_msa stack, the
step's time over 5 steps by CUDA events, and the idle gaps between one profiled step's
kernels.

    python3 benchmarks/profile_msa_step.py [--seq-len 1m] [--granularity token] [--q-block 8]
        [--scores bf16] [--rows 30] [--memory | --syncs]
"""

from __future__ import annotations

import argparse
import traceback
import warnings
from collections import defaultdict

import torch
from bench_msa import KV_BLOCK, TOP_K, random_inputs
from torch.profiler import ProfilerActivity, profile

from flash_msa.bench import parse_length
from flash_msa.msa import msa_func
from flash_msa.msa.fp8 import FP8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=parse_length, default=parse_length("1m"))
    parser.add_argument("--granularity", default="token")
    parser.add_argument("--q-block", type=int, default=8)
    parser.add_argument("--scores", choices=("bf16", "fp8"), default="bf16")
    parser.add_argument("--rows", type=int, default=30, help="ops listed")
    parser.add_argument("--memory", action="store_true", help="the peak's allocations")
    parser.add_argument("--syncs", action="store_true", help="host synchronisations and gaps")
    args = parser.parse_args()
    inputs = random_inputs(args.seq_len, torch.device("cuda"), "local")
    leaves = [inputs[name] for name in ("q_proxy", "k_proxy", "q", "k", "v")]
    score_dtype = FP8 if args.scores == "fp8" else None
    options = dict(top_k=TOP_K, q_block=args.q_block, kv_block=KV_BLOCK,
                   granularity=args.granularity, score_dtype=score_dtype)  # fmt: skip

    def step():
        for leaf in leaves:
            leaf.grad = None
        out, kl_loss = msa_func(*leaves, **options)
        torch.autograd.backward([out, kl_loss], [inputs["dout"], None])

    step()  # compiles
    torch.cuda.synchronize()
    print(f"===== S {args.seq_len:,}, {options}, local proxies")
    if args.memory:
        print_peak_allocations(step)
        return
    if args.syncs:
        print_synchronisations(step)
        return
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    print("2 steps profiled")
    print(profiler.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows,
                                        max_name_column_width=70))  # fmt: skip


def print_peak_allocations(step, smallest: int = 1 << 24) -> None:
    """The allocations of one step() alive at its peak, summed by call site (peak_sites),
    those of at least smallest bytes."""
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    step()
    torch.cuda.synchronize()
    trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    torch.cuda.memory._record_memory_history(enabled=None)
    peak, sites = peak_sites(trace)
    whole = torch.cuda.max_memory_allocated() / 2**30
    print(f"peak allocated {whole:.3f} GiB, of which the step's own allocations "
          f"{peak / 2**30:.3f} GiB (the rest: what the caller holds)")  # fmt: skip
    for site, (size, count) in sites.items():
        if size >= smallest:
            print(f"{size / 2**30:8.3f} GiB {count:5d} x  {site}")


def print_synchronisations(step, shortest_gap_ms: float = 0.05) -> None:
    """Each call of one step() that synchronises with the device, with its flash_msa frames;
    the mean step over 5 by CUDA events; the gaps of at least shortest_gap_ms between the
    kernels of one profiled step."""

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchronizing CUDA operation" not in str(message):
            return  # the debug mode's own notice
        print("synchronising call:")
        for frame in traceback.extract_stack()[:-2]:
            if "flash_msa/" in frame.filename:
                print(f"    {frame.filename.split('flash_msa/')[-1]}:{frame.lineno} "
                      f"{frame.name}: {frame.line}")  # fmt: skip

    with warnings.catch_warnings():
        warnings.showwarning = show
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        step()
    end.record()
    torch.cuda.synchronize()
    print(f"step {start.elapsed_time(end) / 5:.2f} ms (mean of 5, CUDA events)")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        step()
        torch.cuda.synchronize()
    kernels = sorted((event for event in profiler.events()
                      if event.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda event: event.time_range.start)  # fmt: skip
    busy = sum(event.time_range.elapsed_us() for event in kernels) / 1e3
    span = (kernels[-1].time_range.end - kernels[0].time_range.start) / 1e3
    print(f"profiled step: kernels busy {busy:.2f} ms of a {span:.2f} ms span; gaps:")
    last_end = kernels[0].time_range.end
    for event in kernels[1:]:
        gap_ms = (event.time_range.start - last_end) / 1e3
        if gap_ms >= shortest_gap_ms:
            print(f"{gap_ms:8.3f} ms before {event.name[:70]}")
        last_end = max(last_end, event.time_range.end)


def peak_sites(trace: list[dict]) -> tuple[int, dict[str, list[int]]]:
    """(peak, sites) of an allocator trace (torch.cuda.memory._snapshot's device_traces): peak
    the largest sum of the trace's own live allocations (those it frees but did not make are
    left out), sites each call site's [bytes, allocations] alive then, largest first; a call
    site is an allocation's first three flash_msa frames."""
    live, lifetimes, current, peak, peak_index = {}, [], 0, 0, -1
    for index, event in enumerate(trace):
        if event["action"] == "alloc":
            live[event["addr"]] = [event, index, len(trace)]  # made, freed (never: the end)
            lifetimes.append(live[event["addr"]])
            current += event["size"]
        elif event["action"] == "free_completed" and event["addr"] in live:
            lifetime = live.pop(event["addr"])
            lifetime[2] = index
            current -= lifetime[0]["size"]
        if current > peak:
            peak, peak_index = current, index
    at_peak = [event for event, made, freed in lifetimes if made <= peak_index < freed]
    sites = defaultdict(lambda: [0, 0])
    for event in at_peak:
        frames = [frame for frame in event.get("frames", []) if "flash_msa/" in frame["filename"]]
        site = "; ".join(f"{frame['filename'].split('flash_msa/')[-1]}:{frame['line']} "
                         f"{frame['name']}" for frame in frames[:3])  # fmt: skip
        site = site or "(no flash_msa frame)"
        sites[site][0] += event["size"]
        sites[site][1] += 1
    return peak, dict(sorted(sites.items(), key=lambda item: -item[1][0]))


if __name__ == "__main__":
    main()
