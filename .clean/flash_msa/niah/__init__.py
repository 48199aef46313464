"""Needle in a haystack: does a sparse attention still find the needle?

A synthetic long-context retrieval suite after RULER's needle tasks (single needle, multi-key,
multi-value), generated on the fly from a seed (tasks.py). Small Llama-architecture models
(model.py) are trained from random init on it, one per attention variant, with the same
steps and data (train.py): dense (SDPA), a sliding window of 4096 + 128 sinks, the top-k
key blocks of the true attention (oracle_topk), and MSA (dense warm-up, then top_k 16 with
its KL loss). evaluate.py scores the grid of context length x needle depth; report.py writes
niah.json, niah.md and niah.png; suite.py runs it all, resumably.

On a GPU (an H200: about 1-2 minutes per variant at the defaults, 4 layers, d 512, 8 query /
2 kv heads, 2000 steps of up to 32K tokens at lengths 32-32K): the schedule's model FLOPs,
5.7 PFLOP for dense and 3.8-4.3 for the others, take 29 s and 22-24 s at 300 TFLOP/s of
attention and 150 of the rest, the grid's forwards at 2K-32K 15 s and 7-8 s more::

    flash-msa niah --out benchmarks/results/h200 --max-minutes 9

--max-minutes saves a checkpoint and stops training when the budget is spent (exit status
75; the timing and evaluation of a variant whose training finished still follow, so leave a
minute or two of headroom under a hard limit);
the same command resumes from niah-checkpoints/ (--checkpoint-dir), skipping the variants
already trained and evaluated, until all four are done and the report is written (exit 0)::

    until flash-msa niah --out benchmarks/results/h200 --max-minutes 9; do
        [ $? -eq 75 ] || break
    done

Options change the model (--layers, --dim, --heads, --kv-heads), the schedule (--steps,
--train-len, --batch, --seed), the grid (--context-lens 2k,4k,...,64k, --depths,
--samples) and the variants (--variants dense,msa); a checkpoint trained with other
settings is refused, so start such runs in another --checkpoint-dir. With less GPU memory,
--activation-checkpointing recomputes each layer in the backward.

On the CPU, `TRITON_INTERPRET=1 flash-msa niah --tiny` runs everything at a toy size (a
check that it works, not a result; the interpreter runs the Triton kernels of oracle_topk and
msa).
"""

from flash_msa.niah.evaluate import GridConfig, evaluate_grid
from flash_msa.niah.model import VARIANTS, ModelConfig, NeedleLM, init_parameters
from flash_msa.niah.suite import build_configs, run_suite
from flash_msa.niah.tasks import TASKS, NeedleConfig, make_sample, training_batch
from flash_msa.niah.train import TrainConfig, train

__all__ = [
    "TASKS",
    "VARIANTS",
    "GridConfig",
    "ModelConfig",
    "NeedleConfig",
    "NeedleLM",
    "TrainConfig",
    "build_configs",
    "evaluate_grid",
    "init_parameters",
    "make_sample",
    "run_suite",
    "train",
    "training_batch",
]
