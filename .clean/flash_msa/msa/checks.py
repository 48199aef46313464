"""The checks of MSA's tensors shared by msa_func, msa_func_cp and proxy_kl_loss (TypeError /
ValueError naming the tensor and the fix)."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_tensors(queries: dict, keys: dict, *, rank: int = 4, same_length: bool = True) -> None:
    """queries {"q_proxy": [B, S_q, H_p, D_p], "q": [B, S_q, H_q, D]} and keys {"k_proxy":
    [B, S, H_pk, D_p], "k": [B, S, H_kv, D] (, "v": like k)}, or rank 3: packed [T, H, D];
    one float dtype and one device; S_q = S where same_length (else the queries are some
    blocks of the keys' sequence); H_q a multiple of H_p, H_p of H_kv and of H_pk."""
    shape = "[T, H, D]" if rank == 3 else "[B, S, H, D]"
    q = queries["q"]
    for name, tensor in {**queries, **keys}.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != rank:
            raise ValueError(
                f"{name} must be {rank}-D {shape}"
                f"{' (packed by cu_seqlens)' if rank == 3 else ''}, got {list(tensor.shape)}"
            )
        if tensor.dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"{name} must be float16, bfloat16 or float32, got {tensor.dtype}; "
                "msa_reference computes in float64"
            )
    k, q_proxy, k_proxy = keys["k"], queries["q_proxy"], keys["k_proxy"]
    rows = "T" if rank == 3 else "B and S"
    for name, tensor in {**queries, **keys}.items():
        if (tensor.dtype, tensor.device) != (q.dtype, q.device):
            raise ValueError(
                f"{name} is {tensor.dtype} on {tensor.device} but q is {q.dtype} on "
                f"{q.device}; pass every tensor in one dtype on one device"
            )
        first_name, first = ("q", q) if name in queries else ("k", k)
        if tensor.shape[:-2] != first.shape[:-2]:
            raise ValueError(
                f"{name} {list(tensor.shape)} and {first_name} {list(first.shape)} must agree "
                f"in {rows}"
            )
    mismatch = k.shape[:-2] != q.shape[:-2] if same_length else k.shape[0] != q.shape[0]
    if mismatch:
        raise ValueError(
            f"k {list(k.shape)} and q {list(q.shape)} must agree in "
            f"{rows if same_length else 'B'}"
        )
    v = keys.get("v", k)
    if k.shape != v.shape or k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"k {list(k.shape)} and v {list(v.shape)} must match, with q's head dim {q.shape[-1]}"
        )
    if k_proxy.shape[-1] != q_proxy.shape[-1]:
        raise ValueError(
            f"q_proxy and k_proxy head dims differ ({q_proxy.shape[-1]} vs {k_proxy.shape[-1]})"
        )
    heads_q, heads_kv = q.shape[-2], k.shape[-2]
    heads_proxy, heads_proxy_keys = q_proxy.shape[-2], k_proxy.shape[-2]
    if min(heads_q, heads_kv, heads_proxy, heads_proxy_keys, q.shape[-1], q_proxy.shape[-1]) < 1:
        raise ValueError(
            f"every head count and head dim must be at least 1, got q {list(q.shape)}, "
            f"k {list(k.shape)}, q_proxy {list(q_proxy.shape)}, k_proxy {list(k_proxy.shape)}"
        )
    if heads_q % heads_proxy or heads_proxy % heads_kv or heads_proxy % heads_proxy_keys:
        raise ValueError(
            f"need H_q ({heads_q}) a multiple of H_p ({heads_proxy}), and H_p a multiple of "
            f"H_kv ({heads_kv}) and of H_pk ({heads_proxy_keys}): each proxy head selects for "
            "H_q / H_p query heads that share one kv head"
        )
