"""A million tokens on one GPU: 64-bit addressing, checked on sampled rows against torch_ref."""

import pytest
import torch

from flash_msa import block_sparse_attn_func, patterns
from flash_msa.ops.torch_ref import _row_attention
from flash_msa.testing import relative_error

SEQ_LEN, HEADS, HEAD_DIM = 1 << 20, 16, 128  # S * H * D = 2^31: past int32 offsets


@pytest.mark.gpu
def test_million_tokens_sampled_rows_match_torch_ref():
    device = torch.device("cuda")
    layout = patterns.sliding_window(SEQ_LEN, 4096, device=device) | patterns.global_tokens(
        SEQ_LEN, 128, device=device
    )
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(1, SEQ_LEN, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16,
                    generator=generator).requires_grad_()
        for _ in range(3)
    )  # fmt: skip
    out = block_sparse_attn_func(q, k, v, layout, causal=True)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    # First, middle and last query blocks (the last rows address past 2^31 elements).
    rows = torch.tensor([0, 1, layout.num_q_blocks // 2, layout.num_q_blocks - 1], device=device)
    positions = rows[:, None] * layout.q_block + torch.arange(layout.q_block, device=device)
    positions = positions.flatten()
    exact = [t.detach().float().requires_grad_() for t in (q, k, v)]
    expected, _ = _row_attention(
        *exact, layout, 0, rows, causal=True, window_size=(-1, -1), scale=HEAD_DIM**-0.5
    )  # [1, rows * q_block, H, D]
    expected.backward(grad_out[:, positions].float())
    assert relative_error(out[:, positions], expected) < 1e-2
    assert relative_error(q.grad[:, positions], exact[0].grad[:, positions]) < 2e-2
