"""Per-head layouts: a different pattern for each head (hierarchical sparsity)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from flash_msa.layout import BlockLayout


def stack(layouts: Iterable[BlockLayout]) -> BlockLayout:
    """One layout head per input (each a single-head layout of the same sizes)."""
    if isinstance(layouts, BlockLayout) or not isinstance(layouts, Iterable):
        raise TypeError(
            f"layouts must be a list (or other iterable) of BlockLayouts, got "
            f"{type(layouts).__name__}"
        )
    layouts = list(layouts)
    if len(layouts) == 0:
        raise ValueError("stack() needs at least one layout")
    first = layouts[0]
    for index, layout in enumerate(layouts):
        if not isinstance(layout, BlockLayout):
            raise TypeError(f"layouts[{index}] must be a BlockLayout, got {type(layout).__name__}")
        layout.check_unchanged()  # the stack skips validation: its parts must still be valid
        if layout.num_layouts != 1:
            raise ValueError(
                f"layouts[{index}] already has {layout.num_layouts} layout heads; "
                "stack single-head layouts"
            )
        for name in ("seq_len_q", "seq_len_kv", "q_block", "kv_block", "device"):
            if getattr(layout, name) != getattr(first, name):
                raise ValueError(
                    f"layouts[{index}].{name} = {getattr(layout, name)} differs from "
                    f"layouts[0].{name} = {getattr(first, name)}"
                )
    nnz = torch.tensor([0] + [layout.nnz for layout in layouts], device=first.device).cumsum(0)
    row_offsets = torch.cat([layout.row_offsets for layout in layouts]) + nnz[:-1, None].int()
    return BlockLayout(
        row_offsets,
        torch.cat([layout.col_indices for layout in layouts]),
        seq_len_q=first.seq_len_q,
        seq_len_kv=first.seq_len_kv,
        q_block=first.q_block,
        kv_block=first.kv_block,
        layout_heads=len(layouts),
        validate=False,
    )
