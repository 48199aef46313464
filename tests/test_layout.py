import sys
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flash_msa import BlockLayout, patterns
from flash_msa.layout import heavy_rows_first
from flash_msa.ops.triton.common import tile_order


def random_block_mask(shape, density=0.4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=generator) < density


def layout_of(mask, seq_len_q, seq_len_kv=None, block=16):
    return patterns.from_dense_mask(
        mask, seq_len_q=seq_len_q, seq_len_kv=seq_len_kv, block_size=block
    )


def raw(offsets, cols, **meta):
    return BlockLayout(
        torch.tensor(offsets, dtype=torch.int32),
        torch.tensor(cols, dtype=torch.int32),
        **{"seq_len_q": 64, "q_block": 32, **meta},
    )


def test_attributes_of_a_small_layout():
    layout = raw([[0, 1, 3]], [0, 0, 1], seq_len_q=50, seq_len_kv=40, kv_block=16)
    assert (layout.num_q_blocks, layout.num_kv_blocks) == (2, 3)
    assert (layout.layout_batch, layout.layout_heads, layout.nnz) == (1, 1, 3)
    assert layout.density == pytest.approx(3 / 6)
    assert layout.device == torch.device("cpu")
    dense = layout.to_dense()
    assert dense.tolist() == [[[True, False, False], [True, True, False]]]


@pytest.mark.parametrize(
    "offsets, cols, meta, error, match",
    [
        ([[0, 1, 2]], [0, 1], {}, None, None),
        ([[0, 1]], [0], {}, ValueError, r"row_offsets must have shape .*\[1, 3\], got \[1, 2\]"),
        ([[1, 1, 2]], [0, 1], {}, ValueError, "must start at 0, got 1"),
        ([[0, 1, 1]], [0, 1], {}, ValueError, "must end at nnz = len.* = 2, got 1"),
        ([[0, 2, 1, 2]], [0, 1], {"seq_len_q": 96}, ValueError, "non-decreasing: head 0, row 1"),
        ([[0, 1, 2], [1, 1, 2]], [0, 1], {"layout_heads": 2}, ValueError, "head 1 must start"),
        ([[0, 1, 2]], [0, 2], {}, ValueError, r"col_indices\[1\] = 2 \(head 0, row 1\) is out of"),
        ([[0, 1, 2]], [-1, 0], {}, ValueError, r"col_indices\[0\] = -1"),
        ([[0, 0, 2]], [1, 0], {}, ValueError, "sorted ascending .* head 0, row 1 has 0 after 1"),
        (
            [[0, 0, 2]],
            [1, 1],
            {},
            ValueError,
            "unique within each row: head 0, row 1 has 1 after 1",
        ),
        ([[0, 1, 2]], [0, 1], {"q_block": 48}, ValueError,
         r"q_block must be one of \(1, 2, 4, 8, 16, 32"),
        ([[0, 1, 2]], [0, 1], {"seq_len_q": 0}, ValueError, "seq_len_q must be a positive int"),
    ],
)
def test_constructor_validation(offsets, cols, meta, error, match):
    if error is None:
        raw(offsets, cols, **meta)
        return
    with pytest.raises(error, match=match):
        raw(offsets, cols, **meta)


def test_strided_row_offsets_name_the_bad_entry_without_a_warning():
    good = patterns.causal(256, block_size=64)
    strided = torch.stack([good.row_offsets, good.row_offsets], -1)[..., 0]  # strides (10, 2)
    cols = good.col_indices.clone()
    cols[2] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # searchsorted warned on the strided offsets
        with pytest.raises(ValueError, match="head 0, row 1 has 0 after 0 at entry 2"):
            BlockLayout(strided, cols, seq_len_q=256, q_block=64)


def test_layout_batch_must_divide_the_rows_when_layout_heads_is_left_out():
    offsets, cols = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
    with pytest.raises(ValueError, match="row_offsets holds 1 layouts .* layout_batch 2"):
        BlockLayout(offsets, cols, seq_len_q=128, layout_batch=2)


def test_to_takes_a_device():
    for device in (None, torch.float32):
        with pytest.raises(TypeError, match="device must be a torch.device, str or int"):
            patterns.causal(256).to(device)


def test_constructor_rejects_wrong_dtypes():
    with pytest.raises(ValueError, match="row_offsets must be int32, got torch.int64"):
        BlockLayout(torch.tensor([[0, 1]]), torch.tensor([0], dtype=torch.int32), seq_len_q=16)
    with pytest.raises(TypeError, match="col_indices must be a torch.Tensor, got list"):
        BlockLayout(torch.tensor([[0, 1]], dtype=torch.int32), [0], seq_len_q=16)


def test_constructor_rejects_more_blocks_than_int32_offsets_count():
    """2**31 entries (an expanded view: no memory) would wrap the int32 row_offsets."""
    cols = torch.zeros(1, dtype=torch.int32).expand(2**31)
    offsets = torch.tensor([[0, 2**31 - 1]], dtype=torch.int32)
    message = r"the layout holds 2,147,483,648 active blocks, more than its int32 row_offsets"
    with pytest.raises(ValueError, match=message):
        BlockLayout(offsets, cols, seq_len_q=16, validate=False)


@given(
    heads=st.integers(1, 3),
    seq_len_q=st.integers(1, 100),
    seq_len_kv=st.integers(1, 100),
    density=st.floats(0, 1),
    seed=st.integers(0, 1000),
)
@settings(max_examples=40, deadline=None)
def test_dense_round_trip_and_transpose(heads, seq_len_q, seq_len_kv, density, seed):
    mask = random_block_mask((heads, -(-seq_len_q // 16), -(-seq_len_kv // 16)), density, seed)
    layout = layout_of(mask, seq_len_q, seq_len_kv)
    layout._validate()
    assert torch.equal(layout.to_dense(), mask)
    transposed = layout.transpose()
    transposed._validate()
    assert torch.equal(transposed.to_dense(), mask.transpose(1, 2))
    assert (transposed.seq_len_q, transposed.seq_len_kv) == (seq_len_kv, seq_len_q)
    assert transposed.transpose() is layout


@pytest.mark.parametrize("shapes", [((1, 2), (1, 2)), ((1, 1), (1, 3)), ((2, 1), (1, 3))])
def test_union_and_intersection_broadcast(shapes):
    (batch_a, heads_a), (batch_b, heads_b) = shapes
    mask_a = random_block_mask((batch_a, heads_a, 5, 4), seed=1)
    mask_b = random_block_mask((batch_b, heads_b, 5, 4), seed=2)
    a, b = layout_of(mask_a, 70, 60), layout_of(mask_b, 70, 60)
    union, both = a | b, a & b
    assert (union.layout_batch, union.layout_heads) == (
        max(batch_a, batch_b),
        max(heads_a, heads_b),
    )
    expected_union = (mask_a | mask_b).flatten(0, 1)
    assert torch.equal(union.to_dense(), expected_union)
    assert torch.equal(both.to_dense(), (mask_a & mask_b).flatten(0, 1))
    union._validate()
    both._validate()


def test_set_algebra_rejects_mismatched_layouts():
    a = patterns.causal(64, block_size=16)
    with pytest.raises(ValueError, match="layouts differ in seq_len_q: 64 vs 80"):
        _ = a | patterns.causal(80, block_size=16)
    with pytest.raises(ValueError, match="cannot broadcast layout_heads 2 to 3"):
        _ = layout_of(random_block_mask((2, 4, 4)), 64) | layout_of(
            random_block_mask((3, 4, 4)), 64
        )
    with pytest.raises(TypeError, match="expected a BlockLayout, got int"):
        _ = a | 3


def test_expand_repeats_broadcast_dimensions():
    mask = random_block_mask((1, 2, 3, 3), seed=3)
    expanded = layout_of(mask, 48).expand(3, 2)
    expanded._validate()
    assert torch.equal(expanded.to_dense(), mask.expand(3, 2, 3, 3).flatten(0, 1))


def test_flops_counts_ragged_blocks_exactly():
    layout = patterns.causal(40, block_size=16)  # blocks of 16, 16, 8 tokens
    sizes = [16, 16, 8]
    expected = sum(4 * 32 * sizes[r] * sizes[c] for r in range(3) for c in range(r + 1))
    assert layout.flops(32) == expected


def test_to_dense_refuses_huge_layouts():
    layout = patterns.sliding_window(1 << 22, 64, block_size=16)
    with pytest.raises(ValueError, match="use show\\(\\) or plot\\(\\)"):
        layout.to_dense()


def test_show_draws_active_and_skipped_blocks():
    picture = patterns.causal(48, block_size=16).show()
    assert picture.splitlines() == ["[X][ ][ ]", "[X][X][ ]", "[X][X][X]"]
    cut = patterns.causal(1600, block_size=16).show(max_blocks=4).splitlines()
    assert cut[0] == "[X][ ][ ][ ] ..." and cut[-1].startswith("... (100 x 100 blocks")


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "layout.png"
    patterns.stack([patterns.causal(4096), patterns.sliding_window(4096, 512)]).plot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_heavy_rows_first_orders_rows_by_work():
    layout = patterns.stack(
        [patterns.causal(80, block_size=16), patterns.causal(80, block_size=16)]
    )
    assert layout.heavy_rows_first().tolist() == [4, 3, 2, 1, 0]
    window = patterns.sliding_window(96, 16, block_size=16)  # rows 1.. have 2 blocks, row 0 one
    assert window.heavy_rows_first().tolist() == [1, 2, 3, 4, 5, 0]  # ties keep their order


def test_heavy_rows_first_is_cached_with_row_offsets_until_they_change():
    layout = patterns.causal(80, block_size=16)
    order = layout.heavy_rows_first()
    # a layout rebuilt from the same tensors (as the op does on every call) finds it
    rebuilt = BlockLayout.from_op_arguments(**layout.op_arguments())
    assert rebuilt.heavy_rows_first() is order
    assert tile_order(rebuilt, 8) is tile_order(layout, 8)
    assert tile_order(layout, 8).tolist() == [r * 2 + i for r in [4, 3, 2, 1, 0] for i in (0, 1)]
    # an in-place change is seen: row 0 now holds the most blocks
    layout.row_offsets[0, 1:] += 10
    assert layout.heavy_rows_first().tolist() == [0, 4, 3, 2, 1]
    assert tile_order(layout, 16).tolist() == [0, 4, 3, 2, 1]
    with torch.inference_mode():  # no version counter: computed afresh
        offsets = torch.tensor([[0, 1, 3]], dtype=torch.int32)
        assert heavy_rows_first(offsets).tolist() == [1, 0]


@pytest.mark.parametrize(
    "method, argument, match",
    [
        ("show", {"head": 5}, r"head must be an int in \[0, 1\) .* got 5"),
        ("show", {"head": -1}, r"head must be an int in \[0, 1\) .* got -1"),
        ("show", {"max_blocks": -3}, "max_blocks must be a positive int, got -3"),
        ("show", {"max_blocks": 0}, "max_blocks must be a positive int, got 0"),
        ("flops", {"head_dim": -1}, "head_dim must be a positive int, got -1"),
        ("flops", {"head_dim": 64.0}, "head_dim must be a positive int, got 64.0"),
    ],
)
def test_show_and_flops_refuse_bad_arguments(method, argument, match):
    with pytest.raises(ValueError, match=match):
        getattr(patterns.causal(256, block_size=64), method)(**argument)


@pytest.mark.parametrize("name", ["row_offsets", "col_indices"])
def test_check_unchanged_refuses_tensors_edited_in_place(name):
    layout = patterns.causal(256, block_size=64)
    layout.check_unchanged()
    tensor = getattr(layout, name)
    tensor[..., 3] = int(tensor[..., 3])  # any write counts: the check reads no values
    with pytest.raises(ValueError, match=f"layout.{name} was modified in place after the layout"):
        layout.check_unchanged()
    # A new layout on the edited tensors is checked afresh, and then trusted.
    rebuilt = BlockLayout(layout.row_offsets, layout.col_indices, seq_len_q=256, q_block=64)
    rebuilt.check_unchanged()
    rebuilt._validate()
    rebuilt.check_unchanged()
    rebuilt.col_indices[3] = 50
    with pytest.raises(ValueError, match="build a new layout"):
        rebuilt.check_unchanged()


@pytest.mark.parametrize(
    "derive",
    [lambda bad, good: bad.to("cpu"), lambda bad, good: bad | good, lambda bad, good: good & bad,
     lambda bad, good: bad.expand(1, 2), lambda bad, good: patterns.stack([good, bad]),
     lambda bad, good: bad.transpose()],
)  # fmt: skip
def test_layouts_derived_from_an_edited_one_are_refused(derive):
    """Derived layouts skip validation, so their sources must not have changed since theirs."""
    good = patterns.causal(256, block_size=64)
    bad = BlockLayout(good.row_offsets.clone(), good.col_indices.clone(), seq_len_q=256,
                      q_block=64)  # fmt: skip
    bad.col_indices[0] = 99
    with pytest.raises(ValueError, match="layout.col_indices was modified in place"):
        derive(bad, good)


@pytest.mark.parametrize(
    "keys, error, match",
    [
        (torch.tensor([3, 1]), ValueError, "keys must be ascending and unique"),
        (torch.tensor([1, 1]), ValueError, "keys must be ascending and unique"),
        (torch.tensor([0, 16]), ValueError, r"keys must lie in \[0, 16\)"),
        (torch.tensor([-1, 0]), ValueError, r"keys must lie in \[0, 16\)"),
        (torch.tensor([0.0]), TypeError, "keys must be an int64 tensor, got torch.float32"),
        (torch.tensor([[0]]), ValueError, r"keys must be 1-D \[nnz\]"),
    ],
)
def test_from_keys_checks_its_keys(keys, error, match):
    with pytest.raises(error, match=match):
        BlockLayout.from_keys(keys, seq_len_q=64, seq_len_kv=64, q_block=16, kv_block=16)
    assert BlockLayout.from_keys(torch.tensor([0, 5, 15]), seq_len_q=64, seq_len_kv=64,
                                 q_block=16, kv_block=16).nnz == 3  # fmt: skip


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(q_block=0), r"q_block must be one of \(1, 2, 4, 8, 16, 32, 64, 128\), got 0"),
        (dict(kv_block=0), r"kv_block must be one of \(1, 2, 4, 8, 16, 32, 64, 128\), got 0"),
        (dict(seq_len_q=0), "seq_len_q must be a positive int, got 0"),
        (dict(seq_len_kv=-6), "seq_len_kv must be a positive int, got -6"),
        (dict(layout_batch=0), "layout_batch must be a positive int, got 0"),
    ],
)
def test_from_keys_checks_its_grid_before_its_keys(change, match):
    grid = {**dict(seq_len_q=64, seq_len_kv=64, q_block=16, kv_block=16), **change}
    with pytest.raises(ValueError, match=match):
        BlockLayout.from_keys(torch.tensor([0, 3]), **grid)


def test_check_unchanged_without_version_counters():
    with torch.inference_mode():  # inference tensors track no version: nothing to compare
        layout = patterns.causal(128, block_size=64)
        layout.col_indices[0] = 0
    layout.check_unchanged()

    def rebuild(row_offsets, col_indices):
        traced = BlockLayout(row_offsets, col_indices, seq_len_q=256, q_block=64, validate=False)
        traced.check_unchanged()
        return traced.row_offsets.sum() + traced.col_indices.sum()

    layout = patterns.causal(256, block_size=64)
    compiled = torch.compile(rebuild, backend="aot_eager", fullgraph=True)
    expected = rebuild(layout.row_offsets, layout.col_indices)
    assert compiled(layout.row_offsets, layout.col_indices) == expected


def test_plot_labels_axes_in_tokens_and_is_large(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    figures = []
    savefig = Figure.savefig

    def keep_and_save(figure, *args, **kwargs):
        figures.append(figure)
        savefig(figure, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep_and_save)
    path = tmp_path / "longformer.png"
    patterns.longformer(4096, 512, 128).plot(str(path))
    header = path.read_bytes()[:24]
    width, height = int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")
    assert min(width, height) >= 800
    (axis,) = figures[0].axes
    assert axis.get_xlabel() == "key position (tokens)"
    assert axis.get_ylabel() == "query position (tokens)"
    figures[0].canvas.draw()
    labels = [tick.get_text() for tick in axis.get_xticklabels()]
    assert "1K" in labels and "4K" in labels
    # The blocks stop short of the frame, so the first (global) row is not drawn on it.
    left, right = axis.get_xlim()
    bottom, top = axis.get_ylim()
    assert left < 0 < 4096 < right and top < 0 < 4096 < bottom


@pytest.mark.parametrize("option", ["max_pixels", "max_heads"])
@pytest.mark.parametrize("value", [0, 1.5])
def test_plot_rejects_sizes_that_are_not_positive_ints(tmp_path, option, value):
    with pytest.raises(ValueError, match=f"{option} must be a positive int, got {value}"):
        patterns.causal(256).plot(str(tmp_path / "causal.png"), **{option: value})


def test_plot_takes_a_path():
    with pytest.raises(TypeError, match="path must be a str or os.PathLike, got int"):
        patterns.causal(256).plot(3)


def test_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'flash-msa\[plot\]'"):
        patterns.causal(256).plot(str(tmp_path / "causal.png"))


@pytest.mark.parametrize(
    "sizes, match",
    [
        ({"seq_len_q": True}, "seq_len_q must be a positive int, got True"),
        ({"layout_batch": 0}, "layout_batch must be a positive int, got 0"),
        ({"layout_heads": 0}, "layout_heads must be a positive int, got 0"),
    ],
)
def test_sizes_are_positive_ints(sizes, match):
    causal = patterns.causal(256, block_size=64)
    with pytest.raises(ValueError, match=match):
        BlockLayout(causal.row_offsets, causal.col_indices, **{"seq_len_q": 256, "q_block": 64,
                                                                **sizes})  # fmt: skip
    with pytest.raises(ValueError, match="layout_batch must be a positive int, got 0"):
        causal.expand(0, 1)


def test_sequence_lengths_stay_below_int32_positions():
    causal = patterns.causal(256, block_size=64)
    with pytest.raises(ValueError, match=r"seq_len_kv must be below 2\*\*31 .* got 2147483648"):
        BlockLayout(causal.row_offsets, causal.col_indices, seq_len_q=256, seq_len_kv=2**31,
                    q_block=64, validate=False)  # fmt: skip
    with pytest.raises(ValueError, match=r"seq_len must be below 2\*\*31"):
        patterns.sliding_window(2**31 + 128, 0, block_size=128)


def test_validate_must_be_a_bool():
    causal = patterns.causal(256, block_size=64)
    with pytest.raises(TypeError, match="validate must be a bool, got 'no'"):
        BlockLayout(causal.row_offsets, causal.col_indices, seq_len_q=256, q_block=64,
                    validate="no")  # fmt: skip


@pytest.mark.parametrize("name", ["row_offsets", "col_indices"])
def test_layout_tensors_are_read_only(name):
    layout = patterns.causal(256, block_size=64)
    tensor = getattr(layout, name)
    with pytest.raises(AttributeError, match=f"layout.{name} is read-only: build a new layout"):
        setattr(layout, name, tensor.clone())
    assert getattr(layout, name) is tensor


def test_attach_transpose_checks_the_shapes_of_the_transpose():
    layout = patterns.causal(256, block_size=64)
    transposed = patterns.causal(256, block_size=64).transpose()
    window = patterns.sliding_window(256, 64, block_size=64).transpose()
    bad = [
        ((transposed.row_offsets[:, :3], transposed.col_indices), r"row_offsets must have shape "
         r"\[1, 5\] \(that of this layout's transpose\(\)\), got \[1, 3\]"),
        ((window.row_offsets, window.col_indices), r"col_indices must have shape \[10\]"),
        ((transposed.row_offsets, transposed.col_indices, torch.arange(3)),
         r"entries must have shape \[10\]"),
    ]
    for arguments, match in bad:
        with pytest.raises(ValueError, match=match):
            layout.attach_transpose(*arguments)
    layout.attach_transpose(transposed.row_offsets, transposed.col_indices)
    assert layout.transpose().col_indices is transposed.col_indices


@pytest.mark.parametrize(
    "build",
    [
        lambda: patterns.causal(256, block_size=64, device="meta"),
        lambda: patterns.sliding_window(256, 64, block_size=64, device="meta"),
        lambda: patterns.from_dense_mask(torch.ones(4, 4, dtype=torch.bool, device="meta"),
                                         seq_len_q=256, block_size=64),
        lambda: BlockLayout(torch.zeros(1, 5, dtype=torch.int32, device="meta"),
                            torch.zeros(0, dtype=torch.int32, device="meta"), seq_len_q=256,
                            q_block=64),
        lambda: patterns.documents(torch.tensor([0, 128, 256], dtype=torch.int32, device="meta"),
                                   block_size=64),
    ],
)
def test_layouts_refuse_the_meta_device(build):
    with pytest.raises(ValueError, match="meta device"):
        build()
