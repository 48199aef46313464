"""flash_msa.compat.flash_msa_func (poolside's signature) against the float64 eager MSA."""

import pytest
import torch
from torch import nn

from flash_msa.compat import flash_msa_func
from flash_msa.msa import msa_reference
from flash_msa.testing import relative_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter
SEQ_LEN, DIM = 300, 16  # three kv blocks of 128, the last ragged


def _inputs(batch, heads, seed):
    """[B, H, S, D] q_proxy, k_proxy, q, k, v for heads (H_p, H_pk, H_q, H_kv), float32."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, h, SEQ_LEN, DIM, generator=generator) for h in (*heads, heads[3])]


def _reference(tensors, top_k, scale, document_ids=None):
    """out [B, S, H_q * D] and the KL by msa_reference in float64 ([B, S, H, D] inputs)."""
    exact = [t.double().transpose(1, 2) for t in tensors]
    out, kl_loss, _ = msa_reference(
        *exact, top_k=top_k // 128, q_block=64, kv_block=128, softmax_scale=scale,
        proxy_softmax_scale=scale, document_ids=document_ids,
    )  # fmt: skip
    return out.flatten(2), kl_loss


@pytest.mark.parametrize("top_k", [128, 256, 1024], ids=lambda k: f"top_k={k}")
def test_flash_msa_func_matches_the_eager_msa(top_k, poisoned_allocations):
    """Outputs, the KL (a real value) and the gradients of q, k, v (from the output) and of
    the proxies (from the KL); top_k 1024 is every block: dense causal."""
    tensors = [t.requires_grad_() for t in _inputs(1, (2, 1, 4, 2), seed=top_k)]
    exact = [t.detach().double().requires_grad_() for t in tensors]
    grad_out = torch.randn(1, SEQ_LEN, 4 * DIM, generator=torch.Generator().manual_seed(1))
    scale = DIM**-0.5
    out, kl_loss = flash_msa_func(*(t.to(DEVICE) for t in tensors), top_k, scale)
    expected, expected_kl = _reference(exact, top_k, scale)
    assert out.shape == (1, SEQ_LEN, 4 * DIM)
    assert relative_error(out, expected) < 1e-5
    assert kl_loss.item() > 0 and abs(kl_loss.item() - expected_kl.item()) < 1e-5
    grads = torch.autograd.grad([out, kl_loss], tensors, [grad_out.to(out), None])
    expected_grads = torch.autograd.grad([expected, expected_kl], exact, [grad_out.double(), None])
    for got, want in zip(grads, expected_grads, strict=True):
        assert relative_error(got, want) < 1e-5


@pytest.mark.parametrize("top_k", [128, 256], ids=lambda k: f"top_k={k}")
def test_documents_by_ids_or_cu_seqlens(top_k, poisoned_allocations):
    """document_ids [B, S] and cu_seqlens over the B * S tokens give one result, and it is
    the eager MSA's with those documents: each row's blocks of 128 start at its own first
    token, also where S (300) is not a multiple of 128 (top_k 128 keeps a token's own block
    alone, so a block grid shifted by a row's offset selects other keys)."""
    tensors = _inputs(2, (2, 1, 2, 1), seed=3)
    document_ids = torch.tensor([0] * 140 + [1] * 100 + [2] * 60).expand(2, -1)
    cu_seqlens = torch.tensor([0, 140, 240, 300, 440, 540, 600], dtype=torch.int32)
    on_device = [t.to(DEVICE) for t in tensors]
    by_ids = flash_msa_func(*on_device, top_k, 0.25, document_ids.to(DEVICE))
    by_bounds = flash_msa_func(*on_device, top_k, 0.25, cu_seqlens=cu_seqlens.to(DEVICE))
    for got, want in zip(by_ids, by_bounds, strict=True):
        assert torch.equal(got, want)
    expected, expected_kl = _reference(tensors, top_k, 0.25, document_ids)
    assert relative_error(by_ids[0], expected) < 1e-5
    assert abs(by_ids[1].item() - expected_kl.item()) < 1e-5


def test_an_empty_batch_with_documents():
    """Batch 0 with document_ids [0, S]: empty outputs, as without documents."""
    tensors = [t[:0].to(DEVICE) for t in _inputs(1, (2, 1, 2, 1), seed=4)]
    document_ids = torch.zeros(0, SEQ_LEN, dtype=torch.int32, device=DEVICE)
    out, _ = flash_msa_func(*tensors, 256, 0.25, document_ids)
    assert out.shape == (0, SEQ_LEN, 2 * DIM)


class _Layer(nn.Module):
    """poolside's test model without rotary embeddings: projections, MSA, out [B, S, H * D]."""

    def __init__(self, heads, kernel):
        super().__init__()
        self.heads, self.kernel = heads, kernel
        width = heads[2] * DIM
        self.projections = nn.ModuleList(
            nn.Linear(width, h * DIM, bias=False, dtype=torch.float64) for h in (*heads, heads[3])
        )

    def forward(self, x):
        batch, seq_len, _ = x.shape
        tensors = [
            projection(x).view(batch, seq_len, h, DIM).transpose(1, 2)
            for projection, h in zip(self.projections, (*self.heads, self.heads[3]), strict=True)
        ]
        if self.kernel:
            return flash_msa_func(*(t.float() for t in tensors), 256, DIM**-0.5)
        return _reference(tensors, 256, DIM**-0.5)


def test_sgd_steps_match_the_eager_model(poisoned_allocations):
    """poolside's training check: the parameters after a few SGD steps on task loss + KL
    equal those of the same model on the eager MSA."""
    heads = (2, 1, 4, 2)
    torch.manual_seed(0)
    eager = _Layer(heads, kernel=False)
    kernel = _Layer(heads, kernel=True)
    kernel.load_state_dict(eager.state_dict())
    kernel.to(DEVICE)
    x = torch.randn(1, SEQ_LEN, heads[2] * DIM, dtype=torch.float64)
    target = torch.randn(1, SEQ_LEN, heads[2] * DIM, dtype=torch.float64)
    for model, inputs in ((eager, (x, target)), (kernel, (x.to(DEVICE), target.to(DEVICE)))):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        for _ in range(3):
            out, kl_loss = model(inputs[0])
            loss = (out - inputs[1]).pow(2).mean() + kl_loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    for (name, want), got in zip(eager.named_parameters(), kernel.parameters(), strict=True):
        assert not torch.equal(want, x.new_zeros(()).expand_as(want)), name
        assert relative_error(got.cpu(), want) < 1e-5, name


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(top_k=100), ValueError, "multiple of 128"),
        (dict(top_k=0), ValueError, "multiple of 128"),
        (dict(q=torch.zeros(SEQ_LEN, 4, DIM)), ValueError, r"q must be 4-D \[B, H, S, D\]"),
        (dict(k=torch.zeros(1, 2, 10, DIM)), ValueError, "must agree in B"),
        (dict(document_ids=torch.zeros(1, SEQ_LEN), cu_seqlens=torch.tensor([0, SEQ_LEN])),
         ValueError, "not both"),
        (dict(document_ids=torch.tensor([[1] * 150 + [0] * 150])), ValueError, "non-decreasing"),
        (dict(document_ids=torch.zeros(1, SEQ_LEN)), TypeError, "int32 or int64"),
        (dict(document_ids=torch.zeros(2, SEQ_LEN, dtype=torch.long)), ValueError, r"\[1, 300\]"),
        (dict(scale=float("nan")), ValueError, "scale must be a positive finite float"),
        (dict(scale=-1.0), ValueError, "scale must be a positive finite float"),
        (dict(q=torch.zeros(1, 4, SEQ_LEN, 0)), ValueError, r"q \[1, 4, 300, 0\] needs H, S and D"),
        (dict(v=torch.zeros(1, 2, SEQ_LEN, 8)), ValueError,
         r"q, k, v must share their head dim \(dim 3\): q \[1, 4, 300, 16\]"),
        (dict(k_proxy=torch.zeros(1, 1, SEQ_LEN, 8)), ValueError,
         r"q_proxy, k_proxy must share their head dim"),
    ],
)  # fmt: skip
def test_flash_msa_func_rejects_bad_input(change, error, match):
    names = ("q_proxy", "k_proxy", "q", "k", "v")
    arguments = dict(zip(names, _inputs(1, (2, 1, 4, 2), seed=0), strict=True))
    arguments.update(top_k=256, scale=0.25)
    arguments.update(change)
    with pytest.raises(error, match=match):
        flash_msa_func(**arguments)


def test_cu_seqlens_must_hold_every_row_start():
    tensors = _inputs(2, (2, 1, 2, 1), seed=0)
    bounds = torch.tensor([0, 200, 400, 600], dtype=torch.int32)  # 200-400 spans two rows
    with pytest.raises(ValueError, match="every batch-row boundary"):
        flash_msa_func(*tensors, 256, 0.25, cu_seqlens=bounds)
