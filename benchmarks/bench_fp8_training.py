"""FP8 selection scores in training: a small MSA model trained with bf16 and with FP8 scores.

    python3 benchmarks/bench_fp8_training.py [--granularities token,block] [--steps 600]
        [--train-len 16k] [--out DIR]

The needle benchmark's model and data (flash_msa.niah: 4 layers, d 512, 8 query / 2 kv
heads, MSA top 16 of 128-key blocks, KL weight 0.1, the first quarter of the steps dense)
trains three times per granularity: bf16 scores, FP8 scores (score_dtype float8_e4m3fn)
from the same initial parameters on the same batches, and bf16 scores from another seed
(the run-to-run spread). Per run: the KL and answer losses averaged over the last quarter
of the steps; the FP8 curve's gap to the bf16 one (the mean over the sparse steps of the
absolute difference of their KL losses, each smoothed over 25 steps) beside the two seeds'
gap; and the agreement of the two selections on the trained bf16 model's own proxies (each
layer's, on 4 held-out samples at the training length): the share of the bf16 selection's
choices, (token or query block, proxy head, kv block), that the FP8 selection also makes.

Writes DIR/fp8_training.json and .md (DIR defaults to benchmarks/results/<gpu>/).
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile

import torch
from common import (
    markdown_table,
    parse_length,
    results_dir,
    run_metadata,
    selection_agreement,
    write_report,
)

from flash_msa.msa import select_tokens
from flash_msa.msa.fp8 import FP8
from flash_msa.msa.interface import select
from flash_msa.niah.model import NeedleLM, init_parameters
from flash_msa.niah.suite import build_configs
from flash_msa.niah.tasks import training_batch
from flash_msa.niah.train import train

SMOOTHING = 25  # steps per moving average of the KL curves
HELD_OUT_SAMPLES = 4
HELD_OUT_STEP = 10**6  # the data of a step no run trains on
SCORE_DTYPES = {"bf16": None, "fp8": FP8}


def trained_agreement(model: NeedleLM, tokens: torch.Tensor) -> float:
    """Share of the bf16 selection's choices the FP8 one also makes, over every layer's
    proxies on tokens [B, S] (the model's selections under its own forward)."""
    config = model.config
    counts = [0, 0]

    def compare(attend):
        def wrapped(q_proxy, k_proxy, q, k, v, warmup):
            if config.granularity == "token":
                bf16, fp8 = (
                    select_tokens(q_proxy, k_proxy, top_k=config.top_k, kv_block=config.kv_block,
                                  score_dtype=dtype)
                    for dtype in SCORE_DTYPES.values()
                )  # fmt: skip
                kept = int((bf16 >= 0).sum())
                shared = selection_agreement(bf16, fp8) * kept
            else:  # msa_func's own per-query-block selection
                bf16, fp8 = (
                    select(q_proxy, k_proxy, top_k=config.top_k, q_block=config.q_block,
                           kv_block=config.kv_block, proxy_softmax_scale=1.0,
                           granularity="block", warmup=False, document_ids=None,
                           cu_seqlens=None, score_dtype=dtype)[0].layout
                    for dtype in SCORE_DTYPES.values()
                )  # fmt: skip
                kept, shared = bf16.nnz, (bf16 & fp8).nnz
            counts[0] += kept
            counts[1] += shared
            return attend(q_proxy, k_proxy, q, k, v, warmup)

        return wrapped

    attentions = [layer.attention for layer in model.layers]
    for attention in attentions:
        attention.attend = compare(attention.attend)
    try:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            positions = torch.zeros(1, dtype=torch.int64, device=tokens.device)
            model(tokens, positions)
    finally:
        for attention in attentions:
            del attention.attend  # the class's method again
    return counts[1] / counts[0]


def smoothed(values: list[float]) -> torch.Tensor:
    series = torch.tensor(values, dtype=torch.float64)
    kernel = torch.full((1, 1, SMOOTHING), 1.0 / SMOOTHING, dtype=torch.float64)
    return torch.nn.functional.conv1d(series[None, None], kernel)[0, 0]


def run(granularity: str, scores: str, seed: int, args, device) -> dict:
    model_config, needles, train_config, _ = build_configs(
        steps=args.steps, train_len=args.train_len, msa_warmup=0.25, seed=seed,
        granularity=granularity,
    )  # fmt: skip
    model = NeedleLM("msa", model_config).to(device)
    init_parameters(model, seed)
    for layer in model.layers:
        layer.attention.score_dtype = SCORE_DTYPES[scores]
    with tempfile.TemporaryDirectory() as folder:
        state = train(model, needles, train_config, device=device, progress=False,
                      checkpoint_path=pathlib.Path(folder) / "checkpoint.pt")  # fmt: skip
    history = state.history
    last = history[-max(1, len(history) // 4):]
    sparse = [row for row in history if not train_config.dense_warmup_at(int(row[0]), "msa")]
    record = dict(
        granularity=granularity, scores=scores, seed=seed, steps=args.steps,
        train_len=args.train_len, tokens_per_s=round(state.tokens_per_second),
        kl_last_quarter=sum(row[3] for row in last) / len(last),
        answer_loss_last_quarter=sum(row[2] for row in last) / len(last),
        kl_curve=[round(row[3], 5) for row in sparse],
    )  # fmt: skip
    if scores == "bf16" and seed == args.seed:
        batch = training_batch(HELD_OUT_STEP, args.train_len, HELD_OUT_SAMPLES, needles, seed)
        record["agreement"] = round(trained_agreement(model, batch.tokens.to(device)), 5)
    print({key: value for key, value in record.items() if key != "kl_curve"}, flush=True)
    return record


def curve_gap(first: dict, second: dict) -> float:
    return float((smoothed(first["kl_curve"]) - smoothed(second["kl_curve"])).abs().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--granularities", default="token,block")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--train-len", type=parse_length, default=parse_length("16k"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    records = []
    for granularity in args.granularities.split(","):
        bf16, fp8, other_seed = (
            run(granularity, scores, seed, args, device)
            for scores, seed in (("bf16", args.seed), ("fp8", args.seed), ("bf16", args.seed + 1))
        )  # fmt: skip
        for record in (bf16, fp8, other_seed):
            record["gap_to_bf16"] = round(curve_gap(record, bf16), 5)
        records += [bf16, fp8, other_seed]
    meta = run_metadata(device)
    records = [dict(record, **meta) for record in records]
    columns = ["granularity", "scores", "seed", "KL, last quarter", "answer loss, last quarter",
               "KL curve's gap to bf16 seed 0", "agreement", "train tokens/s"]  # fmt: skip
    rows = [
        (r, [r["granularity"], r["scores"], r["seed"], f"{r['kl_last_quarter']:.4f}",
             f"{r['answer_loss_last_quarter']:.4f}", f"{r['gap_to_bf16']:.4f}",
             f"{100 * r['agreement']:.2f}%" if "agreement" in r else "-",
             f"{r['tokens_per_s']:,}"])
        for r in records
    ]  # fmt: skip
    write_report(
        results_dir(args.out, device), "fp8_training", records, meta=meta,
        title="FP8 selection scores in training: KL curves and agreement",
        notes=__doc__.split("\n\n")[2].replace("\n", " "), body=markdown_table(columns, rows),
    )  # fmt: skip


if __name__ == "__main__":
    main()
