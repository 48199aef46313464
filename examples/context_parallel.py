"""Train a small MSA language model with its sequence sharded across processes.

    torchrun --nproc-per-node 2 examples/context_parallel.py            # GPUs: NCCL
    TRITON_INTERPRET=1 torchrun --nproc-per-node 2 examples/context_parallel.py --device cpu \
        --seq-len 256 --steps 2                                          # CPUs: gloo, a minute

Every rank holds the same model and the same batch; the plan shards the sequence (head-tail
chunks), each rank embeds and runs its tokens, MSAAttention layers exchange what they need,
and the parameters' gradients are summed over the ranks. Rank 0 also trains a copy of the
model on the whole sequence in one process, and each step's loss must match it.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

from flash_msa.distributed.comm import sum_across_ranks
from flash_msa.modules import MSAAttention

KV_BLOCK = 64  # the MSA layers' key block: the plan gives each rank whole blocks, one at least


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, cp_group, **msa):
        super().__init__()
        self.attention_norm, self.mlp_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention = MSAAttention(dim, heads, cp_group=cp_group, **msa)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, warmup, cp_plan):
        out, kl_loss = self.attention(self.attention_norm(x), warmup=warmup, cp_plan=cp_plan)
        x = x + out
        return x + self.mlp(self.mlp_norm(x)), kl_loss


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, cp_group=None, **msa):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, cp_group, **msa) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens, warmup=False, cp_plan=None):
        """tokens [B, S(_local)] -> logits [B, S(_local), vocab] and the mean KL of layers."""
        x, kl_losses = self.embed(tokens), []
        for block in self.blocks:
            x, kl_loss = block(x, warmup, cp_plan)
            kl_losses.append(kl_loss)
        return self.head(x), torch.stack(kl_losses).mean()


def summed_loss(logits, targets):
    """Next-token cross entropy summed over tokens (targets already shifted)."""
    flat = logits.flatten(0, 1).float()
    return nn.functional.cross_entropy(flat, targets.flatten(), reduction="sum")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments, checked before any process group is made: a bad one ends every rank
    with one error line naming it and the fix."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seq-len", type=int, default=1000,
        help="tokens of each sequence, at least one block of 64 per rank (default: 1000)",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=4, help="SGD steps (default: 4)")
    parser.add_argument(
        "--warmup-steps", type=int, default=1,
        help="first steps whose MSA layers attend densely (default: 1)",
    )  # fmt: skip
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda: a GPU per rank, NCCL; cpu: gloo, with TRITON_INTERPRET=1 (default: cuda "
        "when present)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    missing = [name for name in ("RANK", "WORLD_SIZE") if name not in os.environ]
    if missing:
        parser.error(
            f"{' and '.join(missing)} not set: start the ranks with torchrun, e.g. torchrun "
            "--nproc-per-node 2 examples/context_parallel.py"
        )
    world_size = int(os.environ["WORLD_SIZE"])
    if args.seq_len < 1:
        parser.error(f"--seq-len must be a positive number of tokens, got {args.seq_len}")
    blocks = -(-args.seq_len // KV_BLOCK)
    if blocks < world_size:
        parser.error(
            f"--seq-len {args.seq_len} makes {blocks} block(s) of {KV_BLOCK} tokens for "
            f"{world_size} ranks, each of which holds at least one: pass --seq-len "
            f"{KV_BLOCK * (world_size - 1) + 1} or more, or start fewer ranks (--nproc-per-node)"
        )
    if args.steps < 1:
        parser.error(f"--steps must be a positive int, got {args.steps}")
    if not 0 <= args.warmup_steps <= args.steps:
        parser.error(
            f"--warmup-steps must be in [0, --steps {args.steps}], got {args.warmup_steps}"
        )
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device here; pass --device cpu")
        local_rank, gpus = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
        if local_rank >= gpus:
            parser.error(
                f"--device cuda: local rank {local_rank} has no GPU of its own ({gpus} here): "
                f"start at most {gpus} ranks per node (--nproc-per-node)"
            )
    elif os.environ.get("TRITON_INTERPRET") != "1":
        parser.error(
            "--device cpu runs the MSA Triton kernels in their interpreter: set "
            "TRITON_INTERPRET=1 for the command (TRITON_INTERPRET=1 torchrun ...)"
        )
    return args


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    msa = dict(num_kv_heads=2, num_proxy_heads=2, proxy_head_dim=32, top_k=4, q_block=32,
               kv_block=KV_BLOCK)  # fmt: skip
    model = TinyLM(256, 128, 4, 2, cp_group=dist.group.WORLD, **msa).to(device, dtype)
    for parameter in model.parameters():  # every rank starts from rank 0's weights
        dist.broadcast(parameter.data, src=0)
    single = None  # the one-process reference, on rank 0
    if rank == 0:
        single = TinyLM(256, 128, 4, 2, **msa).to(device, dtype)
        single.load_state_dict(model.state_dict())
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, single) if m]
    plan = model.blocks[0].attention.cp_plan_for(args.seq_len, device)
    index = plan.token_index(rank)
    generator = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        sequence = torch.randint(256, (2, args.seq_len + 1), generator=generator).to(device)
        inputs, targets = sequence[:, :-1], sequence[:, 1:]
        warmup = step < args.warmup_steps
        logits, kl_loss = model(inputs[:, index], warmup=warmup, cp_plan=plan)
        loss = sum_across_ranks(summed_loss(logits, targets[:, index]), None) / inputs.numel()
        (loss + 0.1 * kl_loss).backward()
        for parameter in model.parameters():  # each rank holds its tokens' part
            dist.all_reduce(parameter.grad)
        line = f"step {step}: loss {loss.item():.5f} kl {kl_loss.item():.5f}"
        if single is not None:
            logits, single_kl = single(inputs, warmup=warmup)
            single_loss = summed_loss(logits, targets) / inputs.numel()
            (single_loss + 0.1 * single_kl).backward()
            gap = abs(loss.item() - single_loss.item())
            line += f" | one process: loss {single_loss.item():.5f} (|diff| {gap:.2e})"
            assert gap <= 1e-3 * max(1.0, abs(single_loss.item())), line
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        if rank == 0:
            print(line, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
