"""Activation checkpointing that keeps MSA's selection.

Recomputing a checkpointed layer reruns msa_func whole, and its selection scores every causal
(query, key) pair of the proxies: at a million tokens that is the largest single cost of the
layer. The selection's output is a few integers per query block, so this context keeps it
and recomputes everything else, as plain checkpointing would:

    torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False,
                                      context_fn=msa_checkpoint_context)
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import flash_msa.msa.interface  # noqa: F401  (registers the selection ops)

SAVED_OPS = frozenset({
    torch.ops.flash_msa.block_selection.default, torch.ops.flash_msa.token_selection.default,
    torch.ops.flash_msa.token_layout.default,
})


def _keep_selection(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def msa_checkpoint_context():
    """context_fn for torch.utils.checkpoint.checkpoint (use_reentrant=False): the
    selections of msa_func (and MSAAttention) are saved in the forward and reused by the
    recomputation; every other op is recomputed."""
    return create_selective_checkpoint_contexts(_keep_selection)
