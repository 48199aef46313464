"""FP8 selection scores: the proxies quantized to e4m3 for the scoring kernels' products.

Block scores and per-token selection may run their proxy products on FP8 tensor cores (e4m3
inputs, fp32 accumulation: twice bf16's rate on Hopper). Each proxy query row is divided by
its own largest magnitude and each kv block of proxy keys by its own, both times e4m3's
largest value, so that every row and block spans e4m3's range; the kernels multiply the
factors back into the maxima they take (a positive factor commutes with a max).
"""

from __future__ import annotations

import math

import torch

from flash_msa import _env

FP8 = torch.float8_e4m3fn  # score_dtype of FP8 scoring


def quantize_proxies(
    q_proxy: torch.Tensor, k_proxy: torch.Tensor, kv_block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FP8 scoring's inputs: (q8 like q_proxy, fp32 q_scales [B, S, H_p], k8 like k_proxy,
    fp32 k_scales [B, H_pk, num_kv_blocks]), q8 and k8 float8_e4m3fn. q8 is each
    (token, head) row of q_proxy over its largest magnitude times e4m3's largest value, 448,
    and q8 * q_scales is q_proxy up to e4m3's rounding; k8 the same per kv block of each key
    head, k8 * k_scales (repeated over a block's keys) is k_proxy. Zero rows and blocks keep
    a factor of 1."""
    largest = torch.finfo(FP8).max
    q_amax = q_proxy.abs().amax(-1, keepdim=True).float()  # [B, S, H_p, 1]
    q8 = (q_proxy.float() * (largest / torch.where(q_amax > 0, q_amax, largest))).to(FP8)
    q_scales = torch.where(q_amax > 0, q_amax / largest, 1.0)[..., 0]  # [B, S, H_p]
    batch, seq_len, heads_keys, _ = k_proxy.shape
    num_kv_blocks = math.ceil(seq_len / kv_block)
    key_amax = k_proxy.abs().amax(-1).float()  # [B, S, H_pk]
    padded = torch.nn.functional.pad(key_amax, (0, 0, 0, num_kv_blocks * kv_block - seq_len))
    block_amax = padded.view(batch, num_kv_blocks, kv_block, heads_keys).amax(2)
    k_scales = torch.where(block_amax > 0, block_amax / largest, 1.0)  # [B, blocks, H_pk]
    key_scales = k_scales.repeat_interleave(kv_block, dim=1)[:, :seq_len, :, None]
    k8 = (k_proxy.float() / key_scales).to(FP8)
    return q8, q_scales, k8, k_scales.transpose(1, 2).contiguous()


def check_score_dtype(score_dtype, device: torch.device) -> None:
    """score_dtype is None or FP8, and FP8 runs on device (tensor cores of sm_89 and up, or
    the interpreter; any CPU device passes before a call)."""
    if score_dtype not in (None, FP8):
        raise ValueError(
            f"score_dtype must be None (the proxies' dtype) or torch.float8_e4m3fn, got "
            f"{score_dtype!r}"
        )
    capability = _env.capability(device)
    if score_dtype == FP8 and capability is not None and capability < (8, 9):
        raise ValueError(
            f"score_dtype torch.float8_e4m3fn needs FP8 tensor cores (compute capability 8.9 "
            f"or more), but {device} has {capability[0]}.{capability[1]}: pass score_dtype=None"
        )
