"""The `flash-msa` command: `demo` (the main job) and `show` (draw a pattern)."""

from __future__ import annotations

import argparse
import inspect
import time

import torch

from flash_msa import patterns
from flash_msa.layout import BlockLayout
from flash_msa.ops.interface import block_sparse_attn_func
from flash_msa.reference import attention_reference, layout_mask
from flash_msa.testing import random_qkv, relative_error

# Builders of a square self-attention layout from sizes alone: `show` draws these.
SHOWABLE = (
    "causal",
    "sliding_window",
    "global_tokens",
    "dilated",
    "random_blocks",
    "bigbird",
    "longformer",
)


def _timed(fn, device: torch.device) -> tuple[object, float]:
    """fn() and its wall time in ms (synchronised on CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return result, 1e3 * (time.perf_counter() - start)


def demo(args: argparse.Namespace) -> int:
    """Sliding window + global tokens: forward and backward, checked against a reference."""
    on_gpu = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if on_gpu else "cpu")
    seq_len = args.seq_len or (16384 if on_gpu else 2048)
    heads, head_dim = (8, 128) if on_gpu else (4, 64)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    window, num_global = seq_len // 8, args.block_size
    layout = patterns.sliding_window(
        seq_len, window, block_size=args.block_size, device=device
    ) | patterns.global_tokens(seq_len, num_global, block_size=args.block_size, device=device)
    print(f"flash-msa demo on {device}: S={seq_len}, H={heads}, D={head_dim}, {dtype}")
    print(f"sliding window {window} + {num_global} global tokens, causal, block {args.block_size}")
    print(layout.show(max_blocks=24))
    print(
        f"{layout.nnz} active blocks of {layout.num_q_blocks * layout.num_kv_blocks}: "
        f"density {layout.density:.4f}"
    )

    q, k, v = random_qkv(
        1, seq_len, heads, head_dim, dtype=dtype, device=device, seed=args.seed, requires_grad=True
    )
    grad_out = torch.randn_like(q)

    def step():
        for tensor in (q, k, v):
            tensor.grad = None
        out = block_sparse_attn_func(q, k, v, layout, causal=True)
        out.backward(grad_out)
        return out

    step()  # warm-up: compilation and caches
    out, elapsed = _timed(step, device)
    # Ground truth: dense float64 on the CPU sizes; the float32 gather reference on the GPU.
    inputs = [
        t.detach().to(torch.float64 if not on_gpu else torch.float32).requires_grad_()
        for t in (q, k, v)
    ]
    if on_gpu:
        expected = block_sparse_attn_func(*inputs, layout, causal=True, backend="torch")
    else:
        expected, _ = attention_reference(*inputs, layout_mask(layout, 1, heads, causal=True))
    expected.backward(grad_out.to(expected.dtype))
    pairs = {
        "out": (out, expected),
        **{
            name: (tensor.grad, reference.grad)
            for name, tensor, reference in zip(("dq", "dk", "dv"), (q, k, v), inputs, strict=True)
        },
    }
    flops = layout.flops(head_dim) * heads * 3.5
    print(
        f"forward + backward: {elapsed:.1f} ms, "
        f"{flops / elapsed / 1e9:.2f} TFLOP/s over active blocks"
    )
    print(
        "max abs error: "
        + ", ".join(
            f"{name} {float((got.detach().float() - want.detach().float()).abs().max()):.2e}"
            for name, (got, want) in pairs.items()
        )
    )
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    errors = {name: relative_error(got, want) for name, (got, want) in pairs.items()}
    ok = all(error < tolerance for error in errors.values())
    print(
        f"relative error (limit {tolerance:g}): "
        + ", ".join(f"{name} {error:.2e}" for name, error in errors.items())
        + (": passed" if ok else ": FAILED")
    )
    return 0 if ok else 1


def show(args: argparse.Namespace) -> int:
    builder = getattr(patterns, args.pattern)
    options = {
        name: getattr(args, name)
        for name in inspect.signature(builder).parameters
        if name not in ("device",) and getattr(args, name, None) is not None
    }
    layout: BlockLayout = builder(**options)
    print(layout)
    if args.out:
        layout.plot(args.out)
        print(f"wrote {args.out}")
    else:
        print(layout.show(max_blocks=args.max_blocks))
    return 0


def _add_builder_options(parser: argparse.ArgumentParser, builder) -> None:
    """One option per builder parameter: --seq-len, --window, --causal/--no-causal, ..."""
    for name, parameter in inspect.signature(builder).parameters.items():
        if name == "device":
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(parameter.default, bool):
            parser.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, default=parameter.default
            )
        elif parameter.default is inspect.Parameter.empty:
            default = 4096 if name == "seq_len" else None
            parser.add_argument(
                flag, dest=name, type=int, default=default, required=default is None
            )
        else:
            parser.add_argument(flag, dest=name, type=int, default=parameter.default)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flash-msa", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser("demo", help="run forward + backward and check it")
    demo_parser.add_argument("--seq-len", type=int, default=None)
    demo_parser.add_argument("--block-size", type=int, default=128)
    demo_parser.add_argument("--seed", type=int, default=0)
    demo_parser.add_argument("--cpu", action="store_true", help="stay on the CPU")
    demo_parser.set_defaults(run=demo)
    show_parser = commands.add_parser("show", help="draw a pattern (ASCII, or PNG with --out)")
    builders = show_parser.add_subparsers(dest="pattern", required=True, metavar="PATTERN")
    for name in SHOWABLE:
        builder = getattr(patterns, name)
        sub = builders.add_parser(name, help=inspect.getdoc(builder).splitlines()[0])
        _add_builder_options(sub, builder)
        sub.add_argument("--out", default=None, help="write a PNG here")
        sub.add_argument("--max-blocks", type=int, default=32)
        sub.set_defaults(run=show)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
