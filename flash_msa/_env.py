"""Facts of the machine and the constants every kernel family shares.

Triton decides between its CPU interpreter and the GPU compiler when a kernel is decorated,
that is when flash_msa is imported: TRITON_INTERPRET=1 must be set before that import.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

LOG2_E = 1.4426950408889634  # kernels use exp2: exp(x) = exp2(x * log2(e))
LN_2 = 0.6931471805599453  # and log(x) = log2(x) * ln(2)

_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def interpreting() -> bool:
    """Whether the Triton kernels were built for the CPU interpreter (TRITON_INTERPRET=1 at
    import)."""
    return _INTERPRETING


def _index(device: torch.device) -> int:
    """A CUDA device's index: the current device's where it names none."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) compute capability of a CUDA device; None for any other device."""
    if device.type != "cuda":
        return None
    return _capability(_index(device))


@functools.cache
def _properties(index: int):
    return torch.cuda.get_device_properties(index)


def _cuda_properties(device: torch.device):
    """torch's properties of a CUDA device, read once per device."""
    return _properties(_index(device))


def on_tensor_device(function):
    """`function` (a custom op's implementation, which launches kernels) run with the CUDA
    device of its first tensor argument current: Triton and Gluon launch on the current
    device, so a call on another GPU's tensors (a model split over the GPUs of one process)
    would otherwise run on the wrong one. Without a CUDA tensor the call runs as it is."""

    @functools.wraps(function)
    def on_device(*args, **kwargs):
        for value in args:
            if isinstance(value, torch.Tensor):
                if value.device.type == "cuda":
                    with torch.cuda.device(value.device):
                        return function(*args, **kwargs)
                break
        return function(*args, **kwargs)

    return on_device


def available_bytes(device: torch.device) -> int:
    """Free memory of the device: the GPU's, the caching allocator's unused blocks included,
    or the machine's for the CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


HOPPER_SHARED_MEMORY = 232_448  # bytes a block may opt into on sm_90 (H100, H200)


def shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one program may use on a CUDA device (Hopper's on any other
    device, where kernels run interpreted or are only compiled)."""
    if device.type != "cuda":
        return HOPPER_SHARED_MEMORY
    return _cuda_properties(device).shared_memory_per_block_optin


HOPPER_L2 = (132, 50 * 2**20)  # an H100's / H200's multiprocessors and L2 bytes


def multiprocessors_and_l2(device: torch.device) -> tuple[int, int]:
    """A CUDA device's multiprocessor count and L2 bytes (an H100's on any other device)."""
    if device.type != "cuda":
        return HOPPER_L2
    properties = _cuda_properties(device)
    return properties.multi_processor_count, properties.L2_cache_size


def can_run_triton(device: torch.device) -> bool:
    """Triton kernels run on CUDA devices, and on the CPU under the interpreter."""
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


def triton_refusal(device: torch.device, dtype: torch.dtype) -> tuple[str, type] | None:
    """Why Triton kernels cannot take tensors of this device and dtype, and the error type
    that says so (TypeError for a dtype); None if they can."""
    if not can_run_triton(device):
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
            return (
                "TRITON_INTERPRET=1 was set after flash_msa was imported; set it before the "
                "import to run the Triton kernels on the CPU",
                ValueError,
            )
        return (
            f"Triton kernels need CUDA tensors (got {device}), or TRITON_INTERPRET=1 set "
            "before importing flash_msa to run them on the CPU",
            ValueError,
        )
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"Triton kernels take float16, bfloat16 or float32, got {dtype}", TypeError
    if device.type == "cpu" and dtype == torch.bfloat16:
        return (
            "Triton's CPU interpreter computes bfloat16 wrongly: use float16 or float32 there",
            TypeError,
        )
    return None


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision: fp32 inputs get exact fp32 products (the tests want 1e-4
    relative), fp16 and bf16 ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


def head_dim_pad(head_dim: int) -> int:
    """Tile width of a head dimension: a power of two, at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(head_dim))
