"""Context parallelism over torch.distributed: one sequence sharded across ranks."""

from flash_msa.distributed.plan import CpPlan, NeededBlocks, RankExchange, cp_plan

__all__ = ["CpPlan", "NeededBlocks", "RankExchange", "cp_plan"]
