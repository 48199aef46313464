"""How the per-token main attention's tiles fill, on bench_msa's local proxies, counted on
the CPU (no GPU): per-token selection (top_k 16 of 128-key blocks, the token's own block
kept) in float32, chunk by chunk of queries, then over MSA's 8-token tiles and the gluon
kernels' steps of half a tile (4 tokens x 16 heads, 64 rows):

- union: the blocks a tile's layout row holds over the blocks its tokens select;
- rows partial: the share of half steps in which a token of the half does not read the
  block (its rows are masked);
- empty: the share of half steps in which no token of the half reads the block (every row
  masked: the step's matmuls add nothing);
- diagonal: the share of half steps on the tile's own kv block (causally masked).

    python3 benchmarks/token_tile_steps.py [--seq-len 128k] [--sample-tiles N]

--sample-tiles counts N tiles drawn at random (seeded) instead of all of them: at 1M the
selection of every token, [H_p, S, kv blocks] bools, takes 32 GiB.
"""

from __future__ import annotations

import argparse

import torch
from bench_msa import KV_BLOCK, TOP_K, local_proxies

from flash_msa.bench import parse_length

TILE = 8  # tokens a main-attention tile (q_block None at H_q / H_p 16)
HALF = TILE // 2  # tokens a gluon step
CHUNK = 2048  # queries a pass of the selection over every token


def selected_blocks(seq_len: int, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """bool [H_p, tokens, kv blocks]: the blocks each token of the query ranges [start, end)
    keeps, range after range."""
    q_proxy, k_proxy = local_proxies(seq_len, "cpu")
    q_proxy, k_proxy = q_proxy[0].float(), k_proxy[0, :, 0].float()  # [S, H_p, D_p], [S, D_p]
    heads, blocks = q_proxy.shape[1], -(-seq_len // KV_BLOCK)
    chosen = torch.zeros(heads, sum(end - start for start, end in ranges), blocks,
                         dtype=torch.bool)  # fmt: skip
    row = 0  # chosen's first row of the range
    for start, end in ranges:
        logits = torch.einsum("chd,kd->hck", q_proxy[start:end], k_proxy[:end])  # [H_p, C, end]
        positions = torch.arange(start, end)
        logits.masked_fill_(torch.arange(end)[None, :] > positions[:, None], float("-inf"))
        visible = -(-end // KV_BLOCK)
        logits = torch.nn.functional.pad(logits, (0, visible * KV_BLOCK - end), value=-torch.inf)
        scores = logits.unflatten(-1, (visible, KV_BLOCK)).amax(-1)  # [H_p, C, visible]
        scores[:, torch.arange(end - start), positions // KV_BLOCK] = float("inf")  # own block
        values, order = scores.topk(min(TOP_K, visible), dim=-1)
        chosen[:, row:row + end - start].scatter_(2, order, values > float("-inf"))
        row += end - start
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=parse_length, default=parse_length("128k"))
    parser.add_argument("--sample-tiles", type=int, default=0, help="0: every tile")
    args = parser.parse_args()
    seq_len = args.seq_len
    if seq_len % TILE:
        parser.error(f"--seq-len must be a multiple of {TILE}")
    if args.sample_tiles:
        generator = torch.Generator().manual_seed(0)
        tiles = torch.randperm(seq_len // TILE, generator=generator)[: args.sample_tiles]
        tiles = tiles.sort().values
        ranges = [(tile * TILE, (tile + 1) * TILE) for tile in tiles.tolist()]
    else:
        tiles = torch.arange(seq_len // TILE)
        ranges = [(start, min(start + CHUNK, seq_len)) for start in range(0, seq_len, CHUNK)]
    chosen = selected_blocks(seq_len, ranges)  # [H_p, tiles x TILE, nk]
    heads = chosen.shape[0]
    union = chosen.view(heads, len(tiles), TILE, -1).any(2)  # [H_p, tiles, nk]
    steps = union.repeat_interleave(2, 1)  # [H_p, halves, nk]: two half steps an entry
    halves = chosen.view(heads, 2 * len(tiles), HALF, -1)
    count = steps.sum().item()
    own = tiles * TILE // KV_BLOCK
    counted = f"{len(tiles):,} sampled tiles" if args.sample_tiles else "every tile"
    print(f"S={seq_len:,} ({counted}): union {union.sum().item() * TILE / chosen.sum().item():.3f}x"
          f" the selected blocks; of {count:,} half steps: rows partial "
          f"{1 - (steps & halves.all(2)).sum().item() / count:.3f}, empty "
          f"{(steps & ~halves.any(2)).sum().item() / count:.3f}, diagonal "
          f"{2 * union[:, torch.arange(len(tiles)), own].sum().item() / count:.3f}")


if __name__ == "__main__":
    main()
