"""The attention backends: what each supports, and which one takes a call.

A backend declares the calls it can run (devices, compute capability, dtypes, head dims,
block sizes, dropout, documents, per-token query masks, a deterministic backward) and its
forward and backward entry points. block_sparse_attn_func validates its inputs once,
describes them as an AttentionCall and asks `select`: a named backend runs if it supports
the call, "auto" takes the fastest one that does, and a call none supports raises one
ValueError that says, per backend, why it refused.

Adding a backend: a folder under ops/ holding its kernels and a Backend, and one
`register` line in ops/__init__.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from flash_msa import _env


def capability_text(capability: tuple[int, int]) -> str:
    """(9, 0) -> "9.0"."""
    return ".".join(map(str, capability))


def capabilities_text(capabilities: tuple[tuple[int, int], ...]) -> str:
    """((8, 0), (9, 0)) -> "8.0 or 9.0"."""
    return " or ".join(map(capability_text, capabilities))


@dataclass(frozen=True)
class AttentionCall:
    """What a backend must handle, read off validated inputs."""

    device: torch.device
    dtype: torch.dtype
    head_dim: int
    q_block: int
    kv_block: int
    dropout: bool
    documents: bool
    deterministic: bool  # the caller asks for a bitwise reproducible backward (and needs one)
    element_masks: bool  # causal or a window bound: blocks may be partial
    seq_len_q: int
    seq_len_kv: int
    batch: int
    heads_q: int
    heads_kv: int
    layout_heads: int
    positions: bool = False  # BlockPositions: blocks of a longer sequence, masked globally
    query_masks: bool = False  # per-token selections: a word of row bits per active block


class QueryMasks(NamedTuple):
    """Per-token selections as a backend receives them (query_masks=): one int64 word per
    active (query block, kv block) pair, bit r set when row r of the query block reads the kv
    block, in the order of each of the layout's two forms."""

    csr: torch.Tensor  # int64 [nnz], aligned with layout.col_indices
    csc: torch.Tensor  # int64 [nnz], aligned with layout.transpose().col_indices


class Refusal(NamedTuple):
    """Why a backend cannot run a call (a sentence), and the error that says so: TypeError
    for a dtype, ValueError for everything else."""

    reason: str
    error: type[Exception] = ValueError


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The log-sum-exp's dtype for inputs of `dtype`: float32, float64 for float64 inputs
    (ground truth stays float64 throughout, e.g. when partial results merge by their lse)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class Backend:
    """One implementation of the block-sparse op.

    forward(q, k, v, layout, *, causal, window_size, softmax_scale, document_ids, dropout_p,
    dropout_seed, positions, query_masks) -> (out, lse: lse_dtype(q.dtype) [B, H_q, S_q]) and
    backward(grad_out, q, k, v, out, lse, layout, *,
    the same options) -> (dq, dk, dv) take validated, kernel-ready tensors (custom_op.py);
    positions is a BlockPositions of int32 tensors or None, query_masks a QueryMasks of
    contiguous int64 tensors or None (query_masks=False: the backend has none and refuses
    calls with them). A backend that has no block positions refuses calls with them in
    `check`.
    `speed` ranks the backends "auto" chooses among on a device type (higher is faster;
    a device type it lacks is reachable by name only, e.g. Triton's CPU interpreter, which
    is for tests). `check` adds what the fields cannot say (None: no objection).
    """

    name: str
    forward: Callable
    backward: Callable
    speed: dict[str, int]
    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    head_dims: Callable[[int], bool]
    head_dims_text: str
    block_sizes: tuple[int, ...]
    q_block_sizes: tuple[int, ...] | None = None  # None: block_sizes (1: a row per token)
    capabilities: tuple[tuple[int, int], ...] | None = None  # CUDA's it runs on; None: any
    dropout: bool = True
    documents: bool = True
    query_masks: bool = True
    deterministic: tuple[str, ...] = ("cpu", "cuda")  # devices of a reproducible backward
    # A faster backward, same arguments, whose sums may come in a varying order (atomics):
    # taken when the caller passes deterministic=False.
    nondeterministic_backward: Callable | None = None
    check: Callable[[AttentionCall], Refusal | None] = field(default=lambda call: None)

    def refusal(self, call: AttentionCall) -> Refusal | None:
        """Why this backend cannot run the call, or None if it can."""
        name, device = self.name, call.device.type
        if device not in self.devices:
            return Refusal(f"{name} runs on {' or '.join(self.devices)}, not {device}")
        capability = _env.capability(call.device)
        if self.capabilities is not None and capability not in self.capabilities:
            have = "none" if capability is None else capability_text(capability)
            return Refusal(
                f"{name} runs on compute capability {capabilities_text(self.capabilities)}, "
                f"not {have}"
            )
        if call.dtype not in self.dtypes:
            names = ", ".join(str(dtype).removeprefix("torch.") for dtype in self.dtypes)
            dtype = str(call.dtype).removeprefix("torch.")
            return Refusal(f"{name} takes {names}, not {dtype}", TypeError)
        if not self.head_dims(call.head_dim):
            return Refusal(f"{name} takes head dims {self.head_dims_text}, not {call.head_dim}")
        q_block_sizes = self.block_sizes if self.q_block_sizes is None else self.q_block_sizes
        for block, sizes in (("q_block", q_block_sizes), ("kv_block", self.block_sizes)):
            size = getattr(call, block)
            if size not in sizes:
                return Refusal(f"{name} takes {block} in {sizes}, not {size}")
        if call.dropout and not self.dropout:
            return Refusal(f"{name} has no dropout")
        if call.documents and not self.documents:
            return Refusal(f"{name} has no document masks")
        if call.query_masks and not self.query_masks:
            return Refusal(f"{name} has no per-token query masks (query_masks=)")
        if call.deterministic and device not in self.deterministic:
            return Refusal(
                f"{name}'s backward on {device} is not bitwise reproducible: pass "
                "deterministic=False"
            )
        return self.check(call)


_BACKENDS: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    """Add a backend (a name already taken raises ValueError)."""
    if backend.name in _BACKENDS or backend.name == "auto":
        raise ValueError(f"a backend named {backend.name!r} is already registered")
    _BACKENDS[backend.name] = backend
    return backend


def unregister(name: str) -> None:
    """Remove a backend registered under name."""
    del _BACKENDS[name]


def names() -> tuple[str, ...]:
    """The registered backends' names."""
    return tuple(_BACKENDS)


def get(name: str) -> Backend:
    """The backend registered under name."""
    if not isinstance(name, str):
        raise TypeError(f"backend must be a str, got {type(name).__name__}")
    if name not in _BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {names()}, got {name!r}")
    return _BACKENDS[name]


def select(call: AttentionCall, backend: str = "auto") -> Backend:
    """The backend that runs the call: `backend` itself if it supports it, for "auto" the
    fastest that does. Otherwise one error naming each refusal (TypeError when every refusal
    is about the dtype, ValueError else)."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    if backend != "auto":
        chosen = get(backend)
        refusal = chosen.refusal(call)
        if refusal is not None:
            raise refusal.error(f"backend={backend!r} cannot run this call: {refusal.reason}")
        return chosen
    refusals = {}
    device = call.device.type
    ranked = sorted(_BACKENDS.values(), key=lambda entry: entry.speed.get(device, -1), reverse=True)
    for entry in ranked:
        refusal = entry.refusal(call)
        if refusal is None and device not in entry.speed:
            refusal = Refusal(f"{entry.name} is not chosen on {device} by 'auto': pass "
                              f"backend={entry.name!r}")  # fmt: skip
        if refusal is None:
            return entry
        refusals[entry.name] = refusal
    error = TypeError if all(r.error is TypeError for r in refusals.values()) else ValueError
    lines = "; ".join(refusal.reason for refusal in refusals.values())
    raise error(f"no backend can run this call: {lines}")
