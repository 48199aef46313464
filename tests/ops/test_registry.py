"""The backend registry: dispatch of block_sparse_attn_func, "auto" by speed, and refusals."""

import dataclasses

import pytest
import torch

from flash_msa import _env, block_sparse_attn_func, patterns
from flash_msa.ops import registry, torch_ref
from flash_msa.testing import random_qkv

LAYOUT = patterns.causal(64, block_size=16)


@pytest.fixture
def fake_backend():
    """A backend faster than every other on the CPU, for fp32 and D = 16 only, that records
    its calls and answers with the torch backend's results."""
    calls = []

    def forward(q, k, v, layout, **options):
        calls.append(("forward", options))
        return torch_ref.attention_forward(q, k, v, layout, **options)

    def backward(grad_out, q, k, v, out, lse, layout, **options):
        calls.append(("backward", options))
        return torch_ref.attention_backward(grad_out, q, k, v, out, lse, layout, **options)

    backend = registry.register(
        registry.Backend(
            name="fake",
            forward=forward,
            backward=backward,
            speed={"cpu": 100},
            devices=("cpu",),
            dtypes=(torch.float32,),
            head_dims=lambda dim: dim == 16,
            head_dims_text="16",
            block_sizes=(16,),
            dropout=False,
        )  # fmt: skip
    )
    yield backend, calls
    registry.unregister("fake")


def test_auto_takes_the_fastest_backend_that_supports_the_call(fake_backend):
    _, calls = fake_backend
    q, k, v = random_qkv(1, 64, 2, 16, requires_grad=True)
    out = block_sparse_attn_func(q, k, v, LAYOUT, causal=True)
    out.sum().backward()
    assert [name for name, _ in calls] == ["forward", "backward"]
    assert calls[0][1]["causal"] is True and calls[0][1]["softmax_scale"] == 16**-0.5
    expected = block_sparse_attn_func(q, k, v, LAYOUT, causal=True, backend="torch")
    assert torch.equal(out, expected)


def test_auto_passes_over_a_backend_that_refuses(fake_backend):
    _, calls = fake_backend
    q, k, v = random_qkv(1, 64, 2, 16, dtype=torch.float64)  # fake takes float32 only
    block_sparse_attn_func(q, k, v, LAYOUT, causal=True)
    q, k, v = random_qkv(1, 64, 2, 16)
    block_sparse_attn_func(q, k, v, LAYOUT, causal=True, dropout_p=0.1)  # fake has no dropout
    assert calls == []


def test_a_named_backend_that_refuses_says_why(fake_backend):
    q, k, v = random_qkv(1, 64, 2, 32)
    with pytest.raises(ValueError, match="backend='fake' cannot run this call: fake takes head "
                                         "dims 16, not 32"):  # fmt: skip
        block_sparse_attn_func(q, k, v, LAYOUT, backend="fake")
    q, k, v = random_qkv(1, 64, 2, 16, dtype=torch.float16)
    with pytest.raises(TypeError, match="fake takes float32, not float16"):
        block_sparse_attn_func(q, k, v, LAYOUT, backend="fake")


def test_a_call_no_backend_supports_names_each_refusal(monkeypatch, fake_backend):
    monkeypatch.delitem(registry._BACKENDS, "gluon")  # it refuses the CPU before the dtype
    for name in ("torch", "triton"):  # every other real backend refuses float64 too
        refusing = dataclasses.replace(registry.get(name), dtypes=(torch.float32,))
        monkeypatch.setitem(registry._BACKENDS, name, refusing)
    q, k, v = random_qkv(1, 64, 2, 16, dtype=torch.float64)
    with pytest.raises(TypeError) as error:
        block_sparse_attn_func(q, k, v, LAYOUT)
    message = str(error.value)
    assert message.startswith("no backend can run this call: ")
    for name in ("fake", "torch", "triton"):
        assert f"{name} takes float32, not float64" in message


def test_deterministic_picks_the_backward_and_refuses_only_calls_that_need_one(fake_backend):
    """deterministic=False takes a backend's nondeterministic backward; the default refuses
    a backend with no reproducible backward on the device, unless nothing needs gradients."""
    backend, calls = fake_backend

    def fast_backward(grad_out, q, k, v, out, lse, layout, **options):
        calls.append(("fast backward", options))
        return torch_ref.attention_backward(grad_out, q, k, v, out, lse, layout, **options)

    atomic = dataclasses.replace(backend, name="atomic", nondeterministic_backward=fast_backward)
    registry.register(atomic)
    irreproducible = dataclasses.replace(backend, name="irreproducible", deterministic=())
    registry.register(irreproducible)
    try:
        q, k, v = random_qkv(1, 64, 2, 16, requires_grad=True)
        for deterministic, taken in ((True, "backward"), (False, "fast backward")):
            calls.clear()
            out = block_sparse_attn_func(q, k, v, LAYOUT, causal=True, backend="atomic",
                                         deterministic=deterministic)  # fmt: skip
            out.sum().backward()
            assert [name for name, _ in calls] == ["forward", taken]
        with pytest.raises(ValueError, match="irreproducible's backward on cpu is not bitwise "
                                             "reproducible: pass deterministic=False"):  # fmt: skip
            block_sparse_attn_func(q, k, v, LAYOUT, backend="irreproducible")
        block_sparse_attn_func(q, k, v, LAYOUT, backend="irreproducible", deterministic=False)
        with torch.no_grad():  # no backward: nothing to reproduce
            block_sparse_attn_func(q, k, v, LAYOUT, backend="irreproducible")
        detached = [t.detach() for t in (q, k, v)]
        block_sparse_attn_func(*detached, LAYOUT, backend="irreproducible")
    finally:
        registry.unregister("atomic")
        registry.unregister("irreproducible")


def test_registration_rules(fake_backend):
    backend, _ = fake_backend
    assert "fake" in registry.names()
    assert registry.get("fake") is backend
    with pytest.raises(ValueError, match="already registered"):
        registry.register(backend)
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
        registry.get("cuda")


def test_the_declared_support_of_the_real_backends(monkeypatch):
    monkeypatch.setattr(_env, "capability", lambda device: None)  # no GPU needed for "cuda"
    call = registry.AttentionCall(
        device=torch.device("cpu"), dtype=torch.float32, head_dim=64, q_block=64, kv_block=128,
        dropout=True, documents=True, deterministic=True, element_masks=True, seq_len_q=1000,
        seq_len_kv=1000, batch=1, heads_q=8, heads_kv=2, layout_heads=2,
    )  # fmt: skip
    assert registry.get("torch").refusal(call) is None  # reproducible on the CPU
    on_cuda = dataclasses.replace(call, device=torch.device("cuda"))
    assert registry.get("torch").refusal(on_cuda).reason == (
        "torch's backward on cuda is not bitwise reproducible: pass deterministic=False"
    )
    assert registry.get("torch").refusal(dataclasses.replace(on_cuda, deterministic=False)) is None
    half_on_cpu = dataclasses.replace(call, dtype=torch.bfloat16)
    refusal = registry.get("triton").refusal(half_on_cpu)  # interpreted bf16, or no interpreter
    assert refusal is not None
    assert refusal.error is (TypeError if _env.interpreting() else ValueError)
    # on the CPU "auto" never picks the interpreter, which is for tests
    assert registry.select(dataclasses.replace(call, deterministic=False)).name == "torch"


def test_rows_of_one_token_need_sixteen_packed_heads(monkeypatch):
    """q_block 1 (a layout row per token): the triton backend's tiles are the query heads
    sharing the row and a kv head, at least tl.dot's 16; kv blocks stay >= 16."""
    monkeypatch.setattr(_env, "triton_refusal", lambda device, dtype: None)  # any machine
    call = registry.AttentionCall(
        device=torch.device("cpu"), dtype=torch.float32, head_dim=128, q_block=1, kv_block=128,
        dropout=False, documents=False, deterministic=False, element_masks=True,
        seq_len_q=4096, seq_len_kv=4096, batch=1, heads_q=64, heads_kv=4, layout_heads=4,
    )  # fmt: skip
    triton_backend = registry.get("triton")
    assert triton_backend.refusal(call) is None
    few = triton_backend.refusal(dataclasses.replace(call, heads_q=16))  # 4 heads per row
    assert "q_block 1 packs 4 heads" in few.reason
    for name in ("triton", "torch"):
        refusal = registry.get(name).refusal(dataclasses.replace(call, kv_block=1))
        assert "takes kv_block in (16, 32, 64, 128), not 1" in refusal.reason


def test_gluon_refuses_what_it_does_not_run(monkeypatch):
    """On an sm_90 device it takes masks, documents and any length; the registry passes
    dropout, block positions and the rest on (here the device's capability is stubbed: no
    GPU is needed)."""
    hopper = {"cuda": (9, 0)}
    monkeypatch.setattr(_env, "capability", lambda device: hopper.get(device.type))
    gluon = registry.get("gluon")
    call = registry.AttentionCall(
        device=torch.device("cuda"), dtype=torch.bfloat16, head_dim=128, q_block=128,
        kv_block=128, dropout=False, documents=False, deterministic=True, element_masks=False,
        seq_len_q=4096, seq_len_kv=4096, batch=1, heads_q=16, heads_kv=4, layout_heads=4,
    )  # fmt: skip
    assert gluon.refusal(call) is None
    for change in (dict(element_masks=True), dict(seq_len_kv=4000), dict(documents=True),
                   dict(q_block=32, query_masks=True), dict(q_block=64)):  # packed heads
        assert gluon.refusal(dataclasses.replace(call, **change)) is None
    for change, reason in (
        (dict(positions=True), "gluon has no block positions"),
        (dict(head_dim=96), "gluon takes head dims 64 and 128, not 96"),
        (dict(q_block=1), "gluon takes q_block in (2, 4, 8, 16, 32, 64, 128), not 1"),
        (dict(q_block=16), "gluon: q_block 16 packs 8 query heads into a tile's 128 rows"),
        (dict(dropout=True), "gluon has no dropout"),
        (dict(layout_heads=2), "gluon takes layout_heads 1, H_kv or H_q, not 2"),
        (dict(dtype=torch.float32), "gluon takes float16, bfloat16, not float32"),
        (dict(device=torch.device("cpu")), "gluon runs on cuda, not cpu"),
    ):
        assert gluon.refusal(dataclasses.replace(call, **change)).reason.startswith(reason)
    monkeypatch.setattr(_env, "capability", lambda device: (10, 0))
    assert gluon.refusal(call).reason == "gluon runs on compute capability 9.0, not 10.0"
