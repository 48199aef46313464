"""Context parallelism over torch.distributed: one sequence sharded across ranks."""

from flash_msa.distributed.plan import CpPlan, NeededBlocks, cp_plan

__all__ = ["CpPlan", "NeededBlocks", "cp_plan"]
