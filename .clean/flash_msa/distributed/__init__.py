"""Context parallelism over torch.distributed: one sequence sharded across ranks."""

from flash_msa.distributed.attention import block_sparse_attn_cp
from flash_msa.distributed.msa import msa_func_cp
from flash_msa.distributed.plan import CpPlan, NeededBlocks, RankExchange, cp_plan

__all__ = [
    "CpPlan",
    "NeededBlocks",
    "RankExchange",
    "block_sparse_attn_cp",
    "cp_plan",
    "msa_func_cp",
]
