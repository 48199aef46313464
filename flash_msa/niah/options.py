"""The `flash-msa niah` options that set configuration fields, for the configs' messages.

The configs are built from Python too, so a message names the field and, where the command
has one, its option: "train_len (--train-len)".
"""

from __future__ import annotations

OPTIONS = {
    "layers": "--layers", "dim": "--dim", "heads": "--heads", "kv_heads": "--kv-heads",
    "steps": "--steps", "train_len": "--train-len", "batch": "--batch", "seed": "--seed",
    "context_lens": "--context-lens", "depths": "--depths", "samples": "--samples",
}  # fmt: skip


def named(field: str) -> str:
    """field, with its `flash-msa niah` option in parentheses where it has one."""
    return f"{field} ({OPTIONS[field]})" if field in OPTIONS else field
