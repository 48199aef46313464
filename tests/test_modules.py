"""The layers: FlashSparseAttention and MSAAttention against references, their argument
checks, and torch.compile(fullgraph=True) around them."""

import functools

import pytest
import torch
from torch import nn

from flash_msa import FlashSparseAttention, patterns
from flash_msa.modules import MSAAttention
from flash_msa.msa import msa_reference
from flash_msa.reference import attention_reference, layout_mask
from flash_msa.testing import relative_error


def test_layer_matches_projections_around_dense_reference():
    torch.manual_seed(0)
    pattern = functools.partial(patterns.sliding_window, window=32)
    layer = FlashSparseAttention(64, 4, num_kv_heads=2, block_size=16, pattern=pattern)
    x = torch.randn(2, 100, 64, requires_grad=True)
    out = layer(x)
    assert out.shape == x.shape
    out.square().sum().backward()
    assert x.grad is not None and layer.qkv_proj.weight.grad.abs().sum() > 0

    q, k, v = layer.qkv_proj(x.detach()).split([64, 32, 32], dim=-1)
    layout = layer.layout_for(100, x.device)
    mask = layout_mask(layout, 2, 4, causal=True)
    expected, _ = attention_reference(
        q.view(2, 100, 4, 16).double(),
        k.view(2, 100, 2, 16).double(),
        v.view(2, 100, 2, 16).double(),
        mask,
    )
    expected = layer.out_proj(expected.reshape(2, 100, 64).float())
    assert torch.allclose(out, expected, atol=1e-5)


def test_layer_accepts_a_fixed_layout_and_caches_builders():
    layout = patterns.causal(64, block_size=16)
    layer = FlashSparseAttention(32, 2, block_size=16, pattern=layout)
    assert layer(torch.randn(1, 64, 32)).shape == (1, 64, 32)
    built = FlashSparseAttention(32, 2, block_size=16)
    assert built.layout_for(64, torch.device("cpu")) is built.layout_for(64, torch.device("cpu"))


def test_assigning_the_pattern_or_block_size_rebuilds_the_layouts():
    layer = FlashSparseAttention(32, 2, block_size=16)
    cpu = torch.device("cpu")
    assert layer.layout_for(64, cpu).nnz == 10  # causal
    layer.pattern = functools.partial(patterns.sliding_window, window=16)
    assert layer.layout_for(64, cpu).nnz == 7
    layer.block_size = 32
    assert layer.layout_for(64, cpu).kv_block == 32
    with pytest.raises(TypeError, match="pattern must be a BlockLayout or a builder, got str"):
        layer.pattern = "causal"
    with pytest.raises(ValueError, match="block_size must be one of"):
        layer.block_size = 100


NON_GROUP_MEMBER = torch.distributed.GroupMember.NON_GROUP_MEMBER  # new_group's, off its ranks


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"embed_dim": 30, "num_heads": 4}, ValueError, "embed_dim 30 must be divisible by"),
        ({"embed_dim": 32, "num_heads": 4, "num_kv_heads": 3}, ValueError, "multiple of num_kv"),
        ({"embed_dim": 32, "num_heads": 4, "pattern": "causal"}, TypeError, "pattern must be"),
        ({"embed_dim": 32, "num_heads": 4, "window_size": (5,)}, ValueError, "window_size must"),
        ({"embed_dim": 32, "num_heads": 4, "causal": 1}, TypeError, "causal must be a bool"),
        ({"embed_dim": 32, "num_heads": 4, "backend": "cuda"}, ValueError, "backend must be"),
        ({"embed_dim": 32, "num_heads": 4, "backend": ["torch"]}, TypeError,
         "backend must be a str, got list"),
        ({"embed_dim": 32, "num_heads": 4, "cp_group": NON_GROUP_MEMBER}, ValueError,
         "cp_group is GroupMember.NON_GROUP_MEMBER: this process is not a member"),
        ({"embed_dim": 32, "num_heads": 4, "block_size": 100}, ValueError, r"block_size must be"),
        ({"embed_dim": 32, "num_heads": 4, "cp_balance": "even"}, ValueError, "cp_balance must"),
    ],
)
def test_layer_argument_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        FlashSparseAttention(**kwargs)
    with pytest.raises(ValueError, match=r"x must be \[batch, seq_len, embed_dim\]"):
        FlashSparseAttention(32, 2)(torch.randn(4, 32))


# ---- MSAAttention: argument checks, gradient routing, and training steps that match the same
# layer attending through the float64 msa_reference -------------------------------------------
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter
TINY = dict(num_kv_heads=2, num_proxy_heads=2, proxy_head_dim=16, top_k=2, q_block=16,
            kv_block=32)  # fmt: skip


def _grad_norm(parameter: torch.Tensor) -> float:
    return 0.0 if parameter.grad is None else float(parameter.grad.norm())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(embed_dim=30), "embed_dim 30 must be divisible by num_heads 4"),
        (dict(num_kv_heads=0), "num_kv_heads must be a positive int, got 0"),
        (dict(num_proxy_heads=3), "num_heads 4 must be a multiple of num_proxy_heads 3"),
        (dict(num_proxy_heads=1), "num_proxy_heads 1 must be a multiple of num_kv_heads 2"),
        (dict(num_proxy_kv_heads=4), "num_proxy_heads 2 must be a multiple of num_proxy_kv_heads"),
        (dict(proxy_head_dim=15), "proxy_head_dim 15 must be even"),
        (dict(embed_dim=12, num_heads=4), "head_dim 3 must be even"),
        (dict(top_k=0), "top_k must be a positive int, got 0"),
        (dict(q_block=48), r"q_block must be one of \(1, 2, 4, 8, 16, 32, 64, 128\), got 48"),
        (dict(q_block=8, granularity="block"), r"q_block must be one of \(16, 32, 64, 128\)"),
        (dict(q_block=2), "q_block 2 with H_q / H_p = 2 query heads .* tiles of 4 rows"),
        (dict(q_block=64, kv_block=32), r"q_block \(64\) must be <= kv_block \(32\)"),
        (dict(rope_base=0.5), "rope_base must be a finite number > 1, got 0.5"),
        (dict(rope_base="1e4"), "rope_base must be a finite number > 1, got '1e4'"),
        (dict(score_dtype=torch.int8), "score_dtype must be None .* got torch.int8"),
    ],
)
def test_msa_layer_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MSAAttention(**{"embed_dim": 32, "num_heads": 4, **TINY, **kwargs})


@pytest.mark.parametrize("x", [torch.randn(1, 64, 32, dtype=torch.float64),
                               torch.ones(1, 64, 32, dtype=torch.int64)])  # fmt: skip
def test_layers_refuse_inputs_in_another_dtype_than_their_weights(x):
    layers = [FlashSparseAttention(32, 2, block_size=16),
              MSAAttention(32, 4, **TINY)]  # fmt: skip
    for layer in layers:
        with pytest.raises(TypeError, match=f"x is {x.dtype} on cpu but the layer's weights"):
            layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts for the projections
        assert layers[0](x.float().bfloat16()).shape == (1, 64, 32)


@pytest.mark.parametrize("layer_class", [FlashSparseAttention, MSAAttention])
@pytest.mark.parametrize(
    "factory, error, match",
    [
        (dict(device="cuda:63"), ValueError, r"device 'cuda:63': this machine has \d+ CUDA device"),
        (dict(device="gpu"), ValueError, "device must name a torch device such as 'cpu'"),
        (dict(dtype=torch.int64), TypeError,
         "dtype must be None or a floating torch.dtype .*, got torch.int64"),
        (dict(dtype="float32"), TypeError, "dtype must be None or .*, got 'float32'"),
        (dict(cp_group="world"), TypeError, "cp_group must be a torch.distributed ProcessGroup"),
        (dict(bias="yes"), TypeError, "bias must be a bool, got 'yes'"),
    ],
)
def test_layers_name_a_bad_device_or_dtype(layer_class, factory, error, match):
    options = TINY if layer_class is MSAAttention else {}
    with pytest.raises(error, match=match):
        layer_class(32, 4, **options, **factory)


@pytest.mark.parametrize("layer_class", ["FlashSparseAttention", "MSAAttention"])
def test_layers_take_an_empty_batch_and_refuse_what_is_not_a_sequence(layer_class):
    """B = 0 gives empty outputs; a sequence of no token and an input that is not a tensor
    get errors that name x."""
    if layer_class == "MSAAttention":
        layer = MSAAttention(32, 4, **TINY, device=DEVICE)
    else:
        layer = FlashSparseAttention(32, 4, block_size=32, device=DEVICE)
    result = layer(torch.randn(0, 96, 32, device=DEVICE))
    out = result[0] if layer_class == "MSAAttention" else result
    assert out.shape == (0, 96, 32)
    with pytest.raises(ValueError, match=r"seq_len at least 1, got shape \[2, 0, 32\]"):
        layer(torch.randn(2, 0, 32, device=DEVICE))
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got ndarray"):
        layer(torch.randn(2, 96, 32).numpy())


def test_shapes_and_gradient_routing():
    torch.manual_seed(0)
    layer = MSAAttention(32, 4, **TINY, device=DEVICE)
    x = torch.randn(2, 96, 32, device=DEVICE)
    out, kl_loss = layer(x)
    assert out.shape == (2, 96, 32) and kl_loss.shape == () and kl_loss.item() > 0
    with pytest.raises(ValueError, match=r"x must be \[batch, seq_len, embed_dim\] with embed"):
        layer(x[..., :16])

    # The task loss trains q, k, v and the output; selection passes nothing to the proxy.
    out.square().mean().backward()
    assert _grad_norm(layer.qkv_proj.weight) > 0 and _grad_norm(layer.out_proj.weight) > 0
    assert _grad_norm(layer.proxy_proj.weight) == 0
    # kl_loss trains the proxy only.
    layer.zero_grad(set_to_none=True)
    layer(x)[1].backward()
    assert _grad_norm(layer.proxy_proj.weight) > 0
    assert _grad_norm(layer.qkv_proj.weight) == 0 and _grad_norm(layer.out_proj.weight) == 0


class _ReferenceMSAAttention(MSAAttention):
    """MSAAttention attending through msa_reference in float64."""

    def attend(self, q_proxy, k_proxy, q, k, v, warmup):
        out, kl_loss, _ = msa_reference(
            *(tensor.double() for tensor in (q_proxy, k_proxy, q, k, v)),
            top_k=self.top_k, q_block=self.q_block, kv_block=self.kv_block, warmup=warmup,
        )  # fmt: skip
        return out.to(q.dtype), kl_loss.to(q.dtype)


class _TinyModel(nn.Module):
    """Two residual MSA layers: the second's kl_loss also trains the first, through its input."""

    def __init__(self, layer_class, q_block):
        super().__init__()
        options = dict(TINY, q_block=q_block)
        self.layers = nn.ModuleList(
            layer_class(32, 4, **options, bias=True, device=DEVICE) for _ in range(2)
        )

    def forward(self, x, warmup):
        kl_total = 0.0
        for layer in self.layers:
            out, kl_loss = layer(x, warmup=warmup)
            x, kl_total = x + out, kl_total + kl_loss
        return x, kl_total


@pytest.mark.parametrize("q_block", [16, 8])  # per-token tiles of 16 and of 8 tokens
def test_training_steps_match_reference(q_block):
    torch.manual_seed(0)
    model = _TinyModel(MSAAttention, q_block)
    reference = _TinyModel(_ReferenceMSAAttention, q_block)
    reference.load_state_dict(model.state_dict())
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    x = torch.randn(2, 96, 32, device=DEVICE)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, reference)]
    for warmup in (True, False, False):  # a warm-up step, then steps on selected blocks
        losses = []
        for m, optimizer in zip((model, reference), optimizers, strict=True):
            optimizer.zero_grad()
            out, kl_loss = m(x, warmup)
            loss = out.square().mean() + 0.5 * kl_loss
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    trained = dict(reference.named_parameters())
    for name, parameter in model.named_parameters():
        expected = trained[name].detach()
        error = float((parameter.detach() - expected).norm() / expected.norm())
        assert error < 1e-4, f"{name}: relative difference {error:.2e}"
        # Every parameter moved, the proxy's included: the comparison covers real updates.
        moved = float((expected - initial[name]).norm() / initial[name].norm())
        assert moved > 1e-3, f"{name} barely moved ({moved:.1e})"


# ---- torch.compile(fullgraph=True) around the layers ------------------------------------------
def _compiled_matches_eager(layer, x, **kwargs):
    """The compiled layer's outputs and parameter gradients equal the eager layer's."""
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    results = []
    for run in (compiled, layer):
        layer.zero_grad()
        outputs = run(x, **kwargs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        sum(output.float().square().sum() for output in outputs).backward()
        grads = [parameter.grad.clone() for parameter in layer.parameters()]
        results.append(([output.detach() for output in outputs], grads))
    (got, got_grads), (want, want_grads) = results
    for actual, expected in zip(got + got_grads, want + want_grads, strict=True):
        assert relative_error(actual, expected) < 1e-5


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_compiled_sparse_layer(backend):
    """A builder pattern, its layout built by a first eager call (a fixed layout needs none)."""
    torch.manual_seed(0)
    pattern = functools.partial(patterns.bigbird, window=16, num_global=16, num_random=1)
    layer = FlashSparseAttention(32, 2, block_size=16, pattern=pattern, backend=backend)
    x = torch.randn(1, 64, 32, device=DEVICE)
    layer = layer.to(DEVICE)
    layer(x)  # builds and caches the layout for S = 64
    _compiled_matches_eager(layer, x)


def test_compiled_layer_builds_a_new_length_eagerly():
    """Without fullgraph, a length not seen before builds its layout eagerly at a graph break
    (inductor cannot trace a builder's device reads)."""
    torch.manual_seed(0)
    pattern = functools.partial(patterns.sliding_window, window=16)
    layer = FlashSparseAttention(32, 2, block_size=16, pattern=pattern).to(DEVICE)
    torch._dynamo.reset()
    compiled = torch.compile(layer)
    for seq_len in (64, 48):
        x = torch.randn(1, seq_len, 32, device=DEVICE)
        assert relative_error(compiled(x), layer(x)) < 1e-5


@pytest.mark.parametrize("warmup", [False, True])
def test_compiled_msa_layer(warmup):
    torch.manual_seed(0)
    layer = MSAAttention(32, 4, **TINY).to(DEVICE)
    _compiled_matches_eager(layer, torch.randn(1, 96, 32, device=DEVICE), warmup=warmup)
