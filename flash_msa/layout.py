"""BlockLayout: the batched CSR of active (query block, kv block) pairs."""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
from torch.utils.weak import WeakTensorKeyDictionary

BLOCK_SIZES = (16, 32, 64, 128)
# A layout may also hold rows (or, transposed, columns) of one token: per-token selections.
LAYOUT_BLOCK_SIZES = (1, 2, 4, 8, *BLOCK_SIZES)
DENSE_LIMIT = 1 << 28  # elements of to_dense() before it refuses (256 MiB of bool)


def _check_positive_int(name: str, value) -> None:
    if type(value) is not int or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def checked_device(device) -> torch.device | None:
    """device (None, a torch.device, a string such as 'cuda:0', or an int naming a CUDA device)
    as a torch.device: TypeError or ValueError naming it, also for a CUDA device this machine
    does not have (where torch would fail deep inside an allocation)."""
    if device is None:
        return None
    if not isinstance(device, (torch.device, str, int)) or isinstance(device, bool):
        raise TypeError(f"device must be a torch.device, str or int, got {device!r}")
    try:
        parsed = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except RuntimeError:
        raise ValueError(
            f"device must name a torch device such as 'cpu' or 'cuda:0', got {device!r}"
        ) from None
    # torch.cuda.device_count cannot be traced: under torch.compile the eager check is skipped
    if parsed.type == "cuda" and not torch.compiler.is_compiling():
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (parsed.index or 0) >= count:
            raise ValueError(
                f"device {device!r}: this machine has {count} CUDA device(s); pass one of "
                "them or 'cpu'"
            )
    return parsed


def check_not_meta(name: str, device: torch.device | None) -> None:
    """ValueError where `name`, which a builder or a check reads, would be on the meta
    device: it holds no values."""
    if device is not None and device.type == "meta":
        raise ValueError(
            f"{name} is on the meta device, which holds no values to build or check: pass a "
            "real device such as 'cpu' or 'cuda'"
        )


def layout_device(device) -> torch.device | None:
    """checked_device for a pattern builder, which reads the values it builds."""
    parsed = checked_device(device)
    check_not_meta("the layout to build", parsed)
    return parsed


def check_block_size(name: str, value, sizes: tuple[int, ...] = BLOCK_SIZES) -> int:
    """A block size must be one of sizes (an int, not a float or a bool)."""
    if type(value) is not int or value not in sizes:
        raise ValueError(
            f"{name} must be one of {sizes}, got {value!r} (an int; 64 or 128 run fastest)"
        )
    return value


def _first_true(mask: torch.Tensor) -> int:
    return int(mask.nonzero()[0, 0])


# tensor -> {key: (the tensor's version counter, value)}: see derived_from
_DERIVED = WeakTensorKeyDictionary()


def derived_from(tensor: torch.Tensor, key, compute):
    """compute(), a value derived from `tensor` alone, cached per (tensor, key) for as long as
    the tensor lives and is not changed in place (its version counter); computed afresh while
    torch.compile traces and for tensors that track no version (inference mode). A layout
    rebuilt from the same tensors on every call of the op so finds what an earlier call
    derived, without device work or a sync."""
    if torch.compiler.is_compiling():
        return compute()
    try:
        version = tensor._version
    except RuntimeError:  # inference tensors track no version
        return compute()
    entries = _DERIVED.get(tensor)
    if entries is None:
        entries = _DERIVED[tensor] = {}
    cached = entries.get(key)
    if cached is None or cached[0] != version:
        cached = entries[key] = (version, compute())
    return cached[1]


def check_entries(nnz: int) -> None:
    """A layout's active blocks must fit its int32 row_offsets (builders check before they
    allocate them)."""
    if torch.compiler.is_compiling():
        return  # a traced size: checked by eager calls, not traced ones
    if nnz > torch.iinfo(torch.int32).max:
        raise ValueError(
            f"the layout holds {nnz:,} active blocks, more than its int32 row_offsets count "
            "(2**31 - 1): use larger blocks, or fewer layout heads or batch rows a call"
        )


def check_seq_len(name: str, value) -> None:
    """A sequence length: a positive int below 2**31 (the kernels compute token positions in
    int32)."""
    _check_positive_int(name, value)
    if value > torch.iinfo(torch.int32).max:
        raise ValueError(
            f"{name} must be below 2**31 (the kernels compute token positions in int32), got "
            f"{value}"
        )


def _check_grid(seq_len_q, seq_len_kv, q_block, kv_block) -> None:
    """A layout's sequence lengths and block sizes."""
    for name, value in (("seq_len_q", seq_len_q), ("seq_len_kv", seq_len_kv)):
        check_seq_len(name, value)
    check_block_size("q_block", q_block, LAYOUT_BLOCK_SIZES)
    check_block_size("kv_block", kv_block, LAYOUT_BLOCK_SIZES)


def _check_keys(keys, count: int) -> None:
    """from_keys' keys: int64 [nnz], ascending, unique, in [0, count)."""
    if not isinstance(keys, torch.Tensor) or keys.dtype != torch.int64:
        dtype = keys.dtype if isinstance(keys, torch.Tensor) else type(keys).__name__
        raise TypeError(f"keys must be an int64 tensor, got {dtype}; convert with .long()")
    if keys.dim() != 1:
        raise ValueError(f"keys must be 1-D [nnz], got shape {list(keys.shape)}")
    if keys.numel() == 0:
        return
    flags = [keys[0] < 0, keys[-1] >= count, (keys[1:] <= keys[:-1]).any()]
    negative, too_large, unordered = torch.stack(flags).tolist()  # one read from the device
    if unordered:
        raise ValueError("keys must be ascending and unique (sort them with torch.unique)")
    if negative or too_large:
        raise ValueError(
            f"keys must lie in [0, {count}) = [0, layouts * num_q_blocks * num_kv_blocks), got "
            f"values from {int(keys[0])} to {int(keys[-1])}"
        )


def heavy_rows_first(row_offsets: torch.Tensor) -> torch.Tensor:
    """int32 [num_q_blocks]: the query blocks of CSR row pointers [L, num_q_blocks + 1] by
    descending active blocks summed over the L layouts (ties keep their order); cached per
    row_offsets tensor (derived_from)."""

    def compute():
        work = (row_offsets[:, 1:] - row_offsets[:, :-1]).long().sum(0)
        return torch.argsort(work, descending=True, stable=True).int()

    return derived_from(row_offsets, "heavy_rows_first", compute)


def _read_only(name: str) -> property:
    """A layout tensor's attribute, read-only: the layout's checks, transpose and counts hold
    for the tensors it was built on."""

    def refuse(layout, value):
        raise AttributeError(
            f"layout.{name} is read-only: build a new layout (a patterns builder, or "
            "BlockLayout(row_offsets, col_indices, ...) on the new tensors)"
        )

    return property(lambda layout: getattr(layout, f"_{name}"), refuse)


class BlockLayout:
    """Active blocks of the attention matrix, as a batched CSR.

    row_offsets: int32 [L, num_q_blocks + 1], global pointers into col_indices
        (row_offsets[l, -1] == row_offsets[l + 1, 0]; the last is nnz).
    col_indices: int32 [nnz], the active kv blocks of each row, ascending, unique.
    L = layout_batch * layout_heads; a size of 1 broadcasts over batch or heads.
    """

    def __init__(
        self,
        row_offsets: torch.Tensor,
        col_indices: torch.Tensor,
        *,
        seq_len_q: int,
        seq_len_kv: int | None = None,
        q_block: int = 128,
        kv_block: int | None = None,
        layout_batch: int = 1,
        layout_heads: int | None = None,
        validate: bool = True,
    ):
        seq_len_kv = seq_len_q if seq_len_kv is None else seq_len_kv
        kv_block = q_block if kv_block is None else kv_block
        _check_grid(seq_len_q, seq_len_kv, q_block, kv_block)
        if not isinstance(validate, bool):
            raise TypeError(f"validate must be a bool, got {validate!r}")
        for name, tensor in (("row_offsets", row_offsets), ("col_indices", col_indices)):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
            if tensor.dtype != torch.int32:
                raise ValueError(f"{name} must be int32, got {tensor.dtype}; convert with .int()")
        check_entries(col_indices.numel())
        self._row_offsets = row_offsets
        self._col_indices = col_indices
        self.seq_len_q = seq_len_q
        self.seq_len_kv = seq_len_kv
        self.q_block = q_block
        self.kv_block = kv_block
        self.num_q_blocks = math.ceil(seq_len_q / q_block)
        self.num_kv_blocks = math.ceil(seq_len_kv / kv_block)
        num_layouts = row_offsets.shape[0] if row_offsets.dim() == 2 else -1
        _check_positive_int("layout_batch", layout_batch)
        if layout_heads is None:
            if max(num_layouts, 1) % layout_batch:
                raise ValueError(
                    f"row_offsets holds {max(num_layouts, 1)} layouts (its rows), not a multiple "
                    f"of layout_batch {layout_batch}: pass layout_heads, or row_offsets of "
                    "layout_batch * layout_heads rows"
                )
            layout_heads = max(num_layouts, 1) // layout_batch
        _check_positive_int("layout_heads", layout_heads)
        self.layout_batch = layout_batch
        self.layout_heads = layout_heads
        self._transposed: BlockLayout | None = None
        self._transpose_entries: torch.Tensor | None = None
        self._versions = self._tensor_versions()
        if validate:
            self._validate()

    # ---- tensors and sizes -----------------------------------------------------------
    row_offsets = _read_only("row_offsets")
    col_indices = _read_only("col_indices")

    @property
    def num_layouts(self) -> int:
        return self.layout_batch * self.layout_heads

    @property
    def nnz(self) -> int:
        return self.col_indices.numel()

    @property
    def density(self) -> float:
        return self.nnz / (self.num_layouts * self.num_q_blocks * self.num_kv_blocks)

    @property
    def device(self) -> torch.device:
        return self.col_indices.device

    def __repr__(self) -> str:
        return (
            f"BlockLayout(seq_len_q={self.seq_len_q}, seq_len_kv={self.seq_len_kv}, "
            f"q_block={self.q_block}, kv_block={self.kv_block}, layout_batch={self.layout_batch}, "
            f"layout_heads={self.layout_heads}, nnz={self.nnz}, density={self.density:.4g}, "
            f"device={self.device})"
        )

    def _tensor_versions(self) -> tuple[int, int] | None:
        """The version counters of row_offsets and col_indices (every in-place change bumps
        them), or None where they are not tracked: under torch.compile tracing, and for
        inference-mode tensors."""
        if torch.compiler.is_compiling():
            return None
        try:
            return self.row_offsets._version, self.col_indices._version
        except RuntimeError:  # inference tensors track no version
            return None

    def check_unchanged(self) -> None:
        """Raise ValueError if row_offsets or col_indices were changed in place since the
        layout was built (or last validated): its checks, its cached transpose and its counts
        would no longer hold. Two integer comparisons, no device work."""
        if self._versions is None or torch.compiler.is_compiling():
            return
        tensors = (("row_offsets", self.row_offsets), ("col_indices", self.col_indices))
        for (name, tensor), version in zip(tensors, self._versions, strict=True):
            if tensor._version != version:
                raise ValueError(
                    f"layout.{name} was modified in place after the layout was built; build a "
                    "new layout (a patterns builder, or BlockLayout(row_offsets, col_indices, "
                    "...) on the changed tensors) instead of editing its tensors"
                )

    def _validate(self) -> None:
        self._versions = self._tensor_versions()
        offsets, cols = self.row_offsets, self.col_indices
        shape = (self.num_layouts, self.num_q_blocks + 1)
        if offsets.dim() != 2 or tuple(offsets.shape) != shape:
            raise ValueError(
                f"row_offsets must have shape [layout_batch * layout_heads, num_q_blocks + 1] = "
                f"{list(shape)}, got {list(offsets.shape)}"
            )
        if cols.dim() != 1:
            raise ValueError(f"col_indices must be 1-D [nnz], got shape {list(cols.shape)}")
        if offsets.device != cols.device:
            raise ValueError(
                f"row_offsets is on {offsets.device} but col_indices on {cols.device}; "
                "put both on one device"
            )
        check_not_meta("row_offsets", offsets.device)
        if int(offsets[0, 0]) != 0:
            raise ValueError(f"row_offsets must start at 0, got {int(offsets[0, 0])}")
        if int(offsets[-1, -1]) != self.nnz:
            raise ValueError(
                f"row_offsets must end at nnz = len(col_indices) = {self.nnz}, "
                f"got {int(offsets[-1, -1])}"
            )
        step = offsets[:, 1:] - offsets[:, :-1]
        if bool((step < 0).any()):
            head, row = (step < 0).nonzero()[0].tolist()
            raise ValueError(
                f"row_offsets must be non-decreasing: head {head}, row {row} ends before it starts"
            )
        if self.num_layouts > 1:
            gaps = offsets[1:, 0] != offsets[:-1, -1]
            if bool(gaps.any()):
                head = _first_true(gaps) + 1
                raise ValueError(
                    f"row_offsets of head {head} must start where head {head - 1} ends "
                    "(offsets are global into one col_indices)"
                )
        if self.nnz == 0:
            return
        bad = (cols < 0) | (cols >= self.num_kv_blocks)
        if bool(bad.any()):
            entry = _first_true(bad)
            head, row = self._entry_row(entry)
            raise ValueError(
                f"col_indices[{entry}] = {int(cols[entry])} (head {head}, row {row}) is out of "
                f"range [0, {self.num_kv_blocks}) kv blocks"
            )
        row_start = torch.zeros(self.nnz + 1, dtype=torch.bool, device=cols.device)
        row_start[offsets.flatten().long()] = True
        unsorted = (cols[1:] <= cols[:-1]) & ~row_start[1:-1]
        if bool(unsorted.any()):
            entry = _first_true(unsorted) + 1
            head, row = self._entry_row(entry)
            raise ValueError(
                f"col_indices must be sorted ascending and unique within each row: head {head}, "
                f"row {row} has {int(cols[entry])} after {int(cols[entry - 1])} at entry {entry}"
            )

    def _entry_row(self, entry: int) -> tuple[int, int]:
        flat = self.row_offsets[:, :-1].flatten().contiguous()  # searchsorted warns on strides
        index = int(torch.searchsorted(flat, torch.tensor(entry, dtype=flat.dtype), right=True)) - 1
        # Empty rows share an offset with the next one: search finds the last such row.
        return divmod(index, self.num_q_blocks)

    # ---- derived forms -------------------------------------------------------------
    def row_counts(self) -> torch.Tensor:
        """Active blocks per row, int64 [L * num_q_blocks]."""
        return (self.row_offsets[:, 1:] - self.row_offsets[:, :-1]).flatten().long()

    def heavy_rows_first(self) -> torch.Tensor:
        """int32 [num_q_blocks]: the rows by descending work summed over the L layouts (ties
        keep their order), cached with row_offsets. Kernels launch the longest rows first,
        so the grid ends on short ones instead of waiting for a long last row."""
        return heavy_rows_first(self.row_offsets)

    def entry_rows(self) -> torch.Tensor:
        """Flat row id (layout * num_q_blocks + row) of each entry, int64 [nnz]."""
        ids = torch.arange(self.num_layouts * self.num_q_blocks, device=self.device)
        return torch.repeat_interleave(ids, self.row_counts(), output_size=self.nnz)

    def keys(self) -> torch.Tensor:
        """int64 [nnz], ascending: (layout * num_q_blocks + row) * num_kv_blocks + col."""
        return self.entry_rows() * self.num_kv_blocks + self.col_indices.long()

    def _transposed_keys(self) -> torch.Tensor:
        """int64 [nnz]: the key of each entry in the transposed layout (see keys())."""
        rows = self.entry_rows()
        layout, row = rows // self.num_q_blocks, rows % self.num_q_blocks
        return (layout * self.num_kv_blocks + self.col_indices.long()) * self.num_q_blocks + row

    def transpose(self) -> BlockLayout:
        """The CSC form, as a layout of kv-block rows listing the query blocks that use them."""
        self.check_unchanged()
        if self._transposed is None:
            keys, self._transpose_entries = self._transposed_keys().sort()
            transposed = BlockLayout.from_keys(keys, **self._transposed_meta(), validate=False)
            transposed._transposed = self
            self._transposed = transposed
        return self._transposed

    def transpose_entries(self) -> torch.Tensor:
        """int64 [nnz]: for each entry of transpose().col_indices, the entry of this layout's
        col_indices naming the same (query block, kv block) pair, cached beside the transpose.
        Data of each pair aligned with col_indices (query masks) reads in the transposed
        order as data[layout.transpose_entries()]."""
        self.transpose()  # computes them with the transpose, unless that was attached
        if self._transpose_entries is None:
            self._transpose_entries = self._transposed_keys().argsort()  # keys are unique
        return self._transpose_entries

    def attach_transpose(
        self,
        row_offsets: torch.Tensor,
        col_indices: torch.Tensor,
        entries: torch.Tensor | None = None,
    ) -> BlockLayout:
        """Adopt an already computed CSC form (the tensors of a transpose() result) and,
        optionally, its transpose_entries(). Their shapes are checked (in eager calls), not
        their values."""
        if not torch.compiler.is_compiling():
            shape = (self.num_layouts, self.num_kv_blocks + 1)
            given = {"row_offsets": (row_offsets, shape), "col_indices": (col_indices, (self.nnz,))}
            if entries is not None:
                given["entries"] = (entries, (self.nnz,))
            for name, (tensor, need) in given.items():
                if tuple(tensor.shape) != need:
                    raise ValueError(
                        f"the transpose's {name} must have shape {list(need)} (that of this "
                        f"layout's transpose()), got {list(tensor.shape)}"
                    )
        transposed = BlockLayout(
            row_offsets, col_indices, **self._transposed_meta(), validate=False
        )
        self._transposed, transposed._transposed = transposed, self
        self._transpose_entries = entries
        return self

    SIZES = ("seq_len_q", "seq_len_kv", "q_block", "kv_block", "layout_batch", "layout_heads")

    def op_arguments(self) -> dict:
        """The layout as custom-op arguments: its CSR and CSC tensors, contiguous (the kernels
        read them flat), and its sizes as a list of ints (see from_op_arguments)."""
        transposed = self.transpose()
        return dict(
            row_offsets=self.row_offsets.contiguous(),
            col_indices=self.col_indices.contiguous(),
            t_row_offsets=transposed.row_offsets.contiguous(),
            t_col_indices=transposed.col_indices.contiguous(),
            sizes=[getattr(self, name) for name in self.SIZES],
        )

    @classmethod
    def from_op_arguments(
        cls, row_offsets, col_indices, t_row_offsets, t_col_indices, sizes
    ) -> BlockLayout:
        """Rebuild an (already validated) layout and its transposed form inside a custom op."""
        layout = cls(
            row_offsets, col_indices, **dict(zip(cls.SIZES, sizes, strict=True)), validate=False
        )
        return layout.attach_transpose(t_row_offsets, t_col_indices)

    def _meta(self) -> dict:
        return dict(
            seq_len_q=self.seq_len_q,
            seq_len_kv=self.seq_len_kv,
            q_block=self.q_block,
            kv_block=self.kv_block,
            layout_batch=self.layout_batch,
            layout_heads=self.layout_heads,
        )

    def _transposed_meta(self) -> dict:
        return dict(
            seq_len_q=self.seq_len_kv,
            seq_len_kv=self.seq_len_q,
            q_block=self.kv_block,
            kv_block=self.q_block,
            layout_batch=self.layout_batch,
            layout_heads=self.layout_heads,
        )

    @classmethod
    def from_keys(
        cls,
        keys: torch.Tensor,
        *,
        seq_len_q: int,
        seq_len_kv: int,
        q_block: int,
        kv_block: int,
        layout_batch: int = 1,
        layout_heads: int = 1,
        validate: bool = True,
    ) -> BlockLayout:
        """Build from ascending unique int64 keys (layout * nq + row) * nk + col (see keys());
        validate: check the keys and the layout (builders that make the keys skip it)."""
        _check_grid(seq_len_q, seq_len_kv, q_block, kv_block)
        for name, value in (("layout_batch", layout_batch), ("layout_heads", layout_heads)):
            _check_positive_int(name, value)
        num_q_blocks = math.ceil(seq_len_q / q_block)
        num_kv_blocks = math.ceil(seq_len_kv / kv_block)
        num_layouts = layout_batch * layout_heads
        if validate:
            _check_keys(keys, num_layouts * num_q_blocks * num_kv_blocks)
        # Keys are sorted, so row r starts at the first key of a row >= r.
        boundaries = torch.arange(num_layouts * num_q_blocks + 1, device=keys.device)
        offsets = torch.searchsorted(keys // num_kv_blocks, boundaries)
        # Row l is offsets[l * nq : (l + 1) * nq + 1]: consecutive rows share their boundary.
        row_offsets = offsets.as_strided((num_layouts, num_q_blocks + 1), (num_q_blocks, 1))
        return cls(
            row_offsets.int(),
            (keys % num_kv_blocks).int(),
            seq_len_q=seq_len_q,
            seq_len_kv=seq_len_kv,
            q_block=q_block,
            kv_block=kv_block,
            layout_batch=layout_batch,
            layout_heads=layout_heads,
            validate=validate,
        )

    def to_dense(self) -> torch.Tensor:
        """bool [L, num_q_blocks, num_kv_blocks]; only for small layouts."""
        size = self.num_layouts * self.num_q_blocks * self.num_kv_blocks
        if size > DENSE_LIMIT:
            raise ValueError(
                f"to_dense() would allocate {size} elements (limit {DENSE_LIMIT}); "
                "use show() or plot(), which work on the compressed form"
            )
        dense = torch.zeros(size, dtype=torch.bool, device=self.device)
        dense[self.keys()] = True
        return dense.view(self.num_layouts, self.num_q_blocks, self.num_kv_blocks)

    def to(self, device: torch.device | str) -> BlockLayout:
        """The layout on another device (its tensors stay int32)."""
        if device is None:
            raise TypeError("device must be a torch.device, str or int, got None")
        device = checked_device(device)
        self.check_unchanged()  # the copy skips validation: its source must still be valid
        return BlockLayout(
            self.row_offsets.to(device), self.col_indices.to(device), **self._meta(), validate=False
        )

    def flops(self, head_dim: int) -> int:
        """Forward FLOPs over the active blocks of all L layouts: 4 * rows * cols * D per block."""
        if type(head_dim) is not int or head_dim < 1:
            raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
        rows = self.entry_rows() % self.num_q_blocks
        q_len = (self.seq_len_q - rows * self.q_block).clamp(max=self.q_block)
        kv_len = (self.seq_len_kv - self.col_indices.long() * self.kv_block).clamp(
            max=self.kv_block
        )
        return 4 * head_dim * int((q_len * kv_len).sum())

    # ---- set algebra ---------------------------------------------------------------
    def expand(self, layout_batch: int, layout_heads: int) -> BlockLayout:
        """Repeat a broadcast (size-1) batch or head dimension to the given sizes."""
        self.check_unchanged()  # the result skips validation: its source must still be valid
        _check_positive_int("layout_batch", layout_batch)
        _check_positive_int("layout_heads", layout_heads)
        if (layout_batch, layout_heads) == (self.layout_batch, self.layout_heads):
            return self
        for name, have, want in (
            ("layout_batch", self.layout_batch, layout_batch),
            ("layout_heads", self.layout_heads, layout_heads),
        ):
            if have not in (1, want):
                raise ValueError(
                    f"cannot broadcast {name} {have} to {want}; sizes must match or be 1"
                )
        batch = torch.arange(layout_batch, device=self.device)[:, None]
        heads = torch.arange(layout_heads, device=self.device)[None, :]
        batch = batch if self.layout_batch > 1 else torch.zeros_like(batch)
        heads = heads if self.layout_heads > 1 else torch.zeros_like(heads)
        source = (batch * self.layout_heads + heads).expand(layout_batch, layout_heads).flatten()
        offsets = self.row_offsets.long()
        counts = offsets[source, -1] - offsets[source, 0]
        starts = offsets[source, 0]
        total = int(counts.sum())
        new_layout = torch.repeat_interleave(
            torch.arange(source.numel(), device=self.device), counts
        )
        first = torch.cumsum(counts, 0) - counts
        entry = starts[new_layout] + torch.arange(total, device=self.device) - first[new_layout]
        cols = self.col_indices[entry]
        row_offsets = offsets[source] - starts[:, None] + first[:, None]
        return BlockLayout(
            row_offsets.int(),
            cols,
            **{**self._meta(), "layout_batch": layout_batch, "layout_heads": layout_heads},
            validate=False,
        )

    def _aligned_keys(self, other: BlockLayout) -> tuple[torch.Tensor, torch.Tensor, dict]:
        if not isinstance(other, BlockLayout):
            raise TypeError(f"expected a BlockLayout, got {type(other).__name__}")
        other.check_unchanged()  # (expand checks self)
        for name in ("seq_len_q", "seq_len_kv", "q_block", "kv_block"):
            if getattr(self, name) != getattr(other, name):
                raise ValueError(
                    f"layouts differ in {name}: {getattr(self, name)} vs {getattr(other, name)}; "
                    "build both for the same sequence lengths and block sizes"
                )
        if self.device != other.device:
            raise ValueError(
                f"layouts are on {self.device} and {other.device}; move one with .to()"
            )
        batch = max(self.layout_batch, other.layout_batch)
        heads = max(self.layout_heads, other.layout_heads)
        meta = {**self._meta(), "layout_batch": batch, "layout_heads": heads}
        return self.expand(batch, heads).keys(), other.expand(batch, heads).keys(), meta

    def __or__(self, other: BlockLayout) -> BlockLayout:
        mine, theirs, meta = self._aligned_keys(other)
        # Merge two ascending key arrays: each key's place is its rank in both.
        merged = torch.empty(mine.numel() + theirs.numel(), dtype=mine.dtype, device=mine.device)
        merged[
            torch.searchsorted(theirs, mine) + torch.arange(mine.numel(), device=mine.device)
        ] = mine
        merged[
            torch.searchsorted(mine, theirs, right=True)
            + torch.arange(theirs.numel(), device=mine.device)
        ] = theirs
        return BlockLayout.from_keys(torch.unique_consecutive(merged), **meta, validate=False)

    def __and__(self, other: BlockLayout) -> BlockLayout:
        mine, theirs, meta = self._aligned_keys(other)
        if theirs.numel() == 0:
            return BlockLayout.from_keys(theirs, **meta, validate=False)
        place = torch.searchsorted(theirs, mine).clamp(max=theirs.numel() - 1)
        return BlockLayout.from_keys(mine[theirs[place] == mine], **meta, validate=False)

    # ---- pictures ------------------------------------------------------------------
    def show(self, max_blocks: int = 32, head: int = 0) -> str:
        """ASCII picture of one layout head: [X] active, [ ] skipped (cut to max_blocks)."""
        if type(max_blocks) is not int or max_blocks < 1:
            raise ValueError(f"max_blocks must be a positive int, got {max_blocks!r}")
        if type(head) is not int or not 0 <= head < self.num_layouts:
            raise ValueError(
                f"head must be an int in [0, {self.num_layouts}) (the layout has "
                f"layout_batch * layout_heads = {self.num_layouts} heads), got {head!r}"
            )
        rows = min(self.num_q_blocks, max_blocks)
        cols = min(self.num_kv_blocks, max_blocks)
        start, end = self.row_offsets[head, 0].long(), self.row_offsets[head, rows].long()
        picture = torch.zeros(rows * self.num_kv_blocks, dtype=torch.bool)
        keys = self.keys()[start:end].cpu() - head * self.num_q_blocks * self.num_kv_blocks
        picture[keys] = True
        picture = picture.view(rows, self.num_kv_blocks)[:, :cols]
        lines = [
            "".join("[X]" if active else "[ ]" for active in line.tolist())
            + (" ..." if cols < self.num_kv_blocks else "")
            for line in picture
        ]
        if rows < self.num_q_blocks:
            lines.append(f"... ({self.num_q_blocks} x {self.num_kv_blocks} blocks in all)")
        return "\n".join(lines)

    def plot(self, path: str, max_pixels: int = 512, max_heads: int = 16) -> None:
        """PNG of the layout, one panel per layout head (the first max_heads), query position
        down and key position across, in tokens. Active blocks are dark on a light grey
        background inside a white margin, so blocks along an edge stand apart from the frame.
        A grid of more than max_pixels blocks a side is binned: a pixel holding any active
        block is coloured, darker the more of its blocks are active. Needs matplotlib
        (pip install 'flash-msa[plot]')."""
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        _check_positive_int("max_pixels", max_pixels)
        _check_positive_int("max_heads", max_heads)
        try:
            import matplotlib
        except ImportError as error:
            raise ModuleNotFoundError(
                "BlockLayout.plot needs matplotlib: pip install 'flash-msa[plot]'",
                name="matplotlib",
            ) from error

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import LinearSegmentedColormap
        from matplotlib.ticker import FuncFormatter, MultipleLocator

        heads = min(self.num_layouts, max_heads)
        row_bin = math.ceil(self.num_q_blocks / max_pixels)
        col_bin = math.ceil(self.num_kv_blocks / max_pixels)
        height = math.ceil(self.num_q_blocks / row_bin)
        width = math.ceil(self.num_kv_blocks / col_bin)
        rows = self.entry_rows().cpu()
        cols = self.col_indices.long().cpu()
        layout, row = rows // self.num_q_blocks, rows % self.num_q_blocks
        keep = layout < heads
        bins = (layout[keep] * height + row[keep] // row_bin) * width + cols[keep] // col_bin
        fill = torch.bincount(bins, minlength=heads * height * width).view(heads, height, width)
        fill = fill.float() / (row_bin * col_bin)
        shade = torch.where(fill > 0, 0.5 + 0.5 * fill, fill)  # one active block still shows
        colours = LinearSegmentedColormap.from_list("layout", ["#e9edf2", "#08306b"])
        grid = math.ceil(math.sqrt(heads))
        panel = {1: 8.0, 2: 6.0}.get(grid, 4.5)  # inches at 100 dpi: 800 px for one head
        figure, axes = plt.subplots(
            math.ceil(heads / grid),
            grid,
            figsize=(panel * grid, panel * math.ceil(heads / grid) + 0.6),
            squeeze=False,
        )
        extent = (0, width * col_bin * self.kv_block, height * row_bin * self.q_block, 0)
        for index, axis in enumerate(axes.flat):
            if index >= heads:
                axis.set_axis_off()
                continue
            axis.imshow(
                shade[index].numpy(), cmap=colours, vmin=0, vmax=1, interpolation="nearest",
                extent=extent, aspect="auto",
            )  # fmt: skip
            # A white margin between the blocks and the frame: edge blocks stay visible.
            margin_q, margin_kv = 0.02 * self.seq_len_q, 0.02 * self.seq_len_kv
            axis.set_xlim(-margin_kv, self.seq_len_kv + margin_kv)
            axis.set_ylim(self.seq_len_q + margin_q, -margin_q)  # query 0 at the top
            for ticks, length in ((axis.xaxis, self.seq_len_kv), (axis.yaxis, self.seq_len_q)):
                ticks.set_major_locator(MultipleLocator(_tick_step(length)))
                ticks.set_major_formatter(FuncFormatter(lambda value, _: _tokens(value)))
            axis.set_xlabel("key position (tokens)")
            axis.set_ylabel("query position (tokens)")
            batch, head = divmod(index, self.layout_heads)
            name = f"head {head}" if self.layout_batch == 1 else f"batch {batch}, head {head}"
            axis.set_title(name)
        binned = f"; a pixel is {row_bin} x {col_bin} blocks" if row_bin * col_bin > 1 else ""
        figure.suptitle(
            f"{self.num_q_blocks} x {self.num_kv_blocks} blocks of {self.q_block} x "
            f"{self.kv_block} tokens, density {self.density:.4g}{binned}"
        )
        figure.tight_layout()
        figure.savefig(path, dpi=100, facecolor="white")
        plt.close(figure)


class BlockPositions(NamedTuple):
    """Where a layout's blocks sit in a longer sequence: the op's `positions=`, for a rank of
    context parallelism that computes some query blocks of a sequence from a compact K/V
    buffer holding only the kv blocks they read.

    Local query block i (rows [i * q_block, (i + 1) * q_block) of q) is global query block
    q_blocks[i]; buffer slot s (rows [s * kv_block, (s + 1) * kv_block) of k and v) holds
    global kv block kv_blocks[s]; the layout's col_indices name slots. Causal and window
    masks, document ids, the ragged end of the sequence and dropout's bits all see global
    positions, so each output row is the row the whole-sequence call computes. Neither
    tensor needs to be sorted.

    Example: S = 300, q_block = kv_block = 64 (global blocks 0..4, block 4 holds 44
    tokens). A rank computing global query blocks 0 and 4 (head-tail) under a causal
    layout reads kv blocks 0..4; its buffer may hold them in any order, say 4, 0, 1, 2, 3:

        >>> positions = BlockPositions(torch.tensor([0, 4]), torch.tensor([4, 0, 1, 2, 3]), 300)

    q holds 64 + 44 = 108 rows (its last local block is the ragged global one), k and v
    5 * 64 = 320 rows (slot 0's rows past global position 299 are padding: never read into
    results), and the local layout (seq_len_q=108, seq_len_kv=320) has rows [1] (slot 1 =
    block 0) and [0, 1, 2, 3, 4].
    """

    q_blocks: torch.Tensor  # int [layout.num_q_blocks]: global query block of each local one
    kv_blocks: torch.Tensor  # int [layout.num_kv_blocks]: global kv block in each buffer slot
    seq_len: int  # the global sequence length (self-attention: queries and keys)


def _tick_step(length: int) -> int:
    """A power-of-two tick spacing giving at most 8 ticks over length tokens."""
    return 1 << max(0, math.ceil(math.log2(max(length, 1) / 8)))


def _tokens(value: float) -> str:
    """A token position as a tick label: 512, 1K, 1.5K, 128K, 1M (K = 1024)."""
    value = int(round(value))
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if abs(value) >= size:
            return f"{value / size:g}{unit}"
    return str(value)
