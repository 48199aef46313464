"""The flash-msa command: demo runs forward + backward and checks them against a reference,
show draws a pattern, info prints the versions, the device and the attention backends, bench
times flash-msa against FlexAttention and SDPA, niah runs the needle-in-a-haystack
benchmark."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import torch

from flash_msa import patterns
from flash_msa.bench import LAYOUTS as BENCH_LAYOUTS
from flash_msa.layout import BLOCK_SIZES, BlockLayout
from flash_msa.ops import registry
from flash_msa.ops.fastest import elapsed_ms
from flash_msa.ops.interface import block_sparse_attn_func
from flash_msa.reference import attention_reference, layout_mask
from flash_msa.testing import random_qkv, relative_error

# Builders of a square self-attention layout from sizes alone, which show draws, and what each
# keeps, in a sentence for --help.
SHOWABLE = {
    "causal": "every query sees all keys up to its own position",
    "sliding_window": "each query sees the keys within WINDOW tokens of it",
    "global_tokens": "every query sees the first NUM_GLOBAL tokens (sinks)",
    "dilated": "a sliding window keeping every DILATION-th key block",
    "random_blocks": "BLOCKS_PER_ROW random key blocks per query block (seeded)",
    "bigbird": "sliding window + global tokens + random blocks (Zaheer et al., 2020)",
    "longformer": "sliding window + global tokens (Beltagy et al., 2020)",
}

# Help of the builders' options: what each means and its unit; the default is added.
OPTION_HELP = {
    "seq_len": "sequence length in tokens, of queries and keys",
    "window": "tokens a query sees on each side it looks, only before it when causal",
    "num_global": "global (sink) tokens at the start, seen by every query",
    "dilation": "keep every DILATION-th key block of the window, counted in blocks (1 keeps all)",
    "blocks_per_row": "random key blocks per query block, counted in blocks",
    "num_random": "random key blocks per query block, counted in blocks",
    "seed": "seed of the random blocks: the same seed gives the same layout on any device",
    "causal": "keep only keys at or before each query; --no-causal looks both ways",
    "block_size": f"block size in tokens for queries and keys, one of {BLOCK_SIZES}",
    "q_block": "query block size in tokens (default: BLOCK_SIZE)",
    "kv_block": "key/value block size in tokens (default: BLOCK_SIZE)",
}
NOT_OPTIONS = ("device", "cu_seqlens")  # tensors and devices: not for the command line


def demo(args: argparse.Namespace) -> int:
    """Sliding window + global tokens: forward and backward, checked against a reference."""
    on_gpu = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if on_gpu else "cpu")
    seq_len = args.seq_len if args.seq_len is not None else (16384 if on_gpu else 2048)
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
    elapsed, out = elapsed_ms(step, device)
    # Ground truth: dense float64 on the CPU sizes; the float32 gather reference on the GPU.
    inputs = [
        t.detach().to(torch.float64 if not on_gpu else torch.float32).requires_grad_()
        for t in (q, k, v)
    ]
    if on_gpu:
        # A reference: its backward's bits need not repeat (torch's on CUDA do not).
        expected = block_sparse_attn_func(*inputs, layout, causal=True, backend="torch",
                                          deterministic=False)  # fmt: skip
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
        if name not in NOT_OPTIONS and getattr(args, name, None) is not None
    }
    layout: BlockLayout = builder(**options)
    if args.out:
        try:
            layout.plot(args.out)
        except OSError as error:  # a folder this process may not write into after all
            raise ValueError(f"cannot write {args.out}: {error.strerror or error}") from error
        print(f"{layout}\nwrote {args.out}")
    else:
        picture = layout.show(max_blocks=args.max_blocks)
        print(f"{layout}\n{picture}")
    return 0


# Names of Backend fields in info's listing (others are shown by their own name).
FIELD_LABELS = {
    "speed": "auto rank",
    "head_dims_text": "head dims",
    "capabilities": "compute capability",
    "documents": "document masks",
    "deterministic": "deterministic backward on",
    "nondeterministic_backward": "faster backward with deterministic=False",
}


def _describe_field(name: str, value) -> str:
    """A Backend field and its value in words."""
    label = FIELD_LABELS.get(name, name.replace("_", " "))
    if isinstance(value, bool):
        text = "yes" if value else "no"
    elif value is None:
        text = "any"
    elif name == "capabilities":
        text = registry.capabilities_text(value)
    elif isinstance(value, dict):
        text = ", ".join(f"{key} {rank}" for key, rank in value.items()) or "none"
    elif isinstance(value, tuple):
        text = ", ".join(str(item).removeprefix("torch.") for item in value)
    else:
        text = str(value)
    return f"{label} {text}"


def _field_value(backend, name: str):
    """A Backend field's value as info lists it (whether a backend has the optional
    backward, not the function)."""
    value = getattr(backend, name)
    return value is not None if name == "nondeterministic_backward" else value


def info(args: argparse.Namespace) -> int:
    """Versions, the device, the Triton interpreter, and what each backend supports."""
    import importlib.metadata
    import platform

    import numpy
    import triton

    from flash_msa import _env

    try:
        version = importlib.metadata.version("flash-msa")
    except importlib.metadata.PackageNotFoundError:
        version = "(not installed)"
    print(f"flash-msa {version}")
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, "
        f"triton {triton.__version__}, numpy {numpy.__version__}"
    )
    if torch.cuda.is_available():
        device, dtype = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
        capability = registry.capability_text(_env.capability(device))
        print(
            f"device: {device} ({torch.cuda.get_device_name(device)}, compute capability "
            f"{capability}; {torch.cuda.device_count()} visible)"
        )
    else:
        device, dtype = torch.device("cpu"), torch.float32
        print("device: cpu (no CUDA device)")
    print(
        f"Triton interpreter: {'on' if _env.interpreting() else 'off'} "
        "(TRITON_INTERPRET=1 before importing flash_msa runs the Triton kernels on the CPU)"
    )
    call = registry.AttentionCall(
        device=device, dtype=dtype, head_dim=128, q_block=128, kv_block=128, dropout=False,
        documents=False, deterministic=False, element_masks=True, seq_len_q=4096,
        seq_len_kv=4096, batch=1, heads_q=16, heads_kv=16, layout_heads=1,
    )  # fmt: skip
    example = (
        f"{device.type}, {str(dtype).removeprefix('torch.')}, D=128, blocks of 128, causal, "
        "S=4096"
    )
    print(
        "backends (auto rank: 'auto' tries higher first; a device type not ranked: by name only):"
    )
    for name in registry.names():
        backend = registry.get(name)
        fields = [
            _describe_field(field.name, _field_value(backend, field.name))
            for field in dataclasses.fields(backend)
            if field.name != "name" and not callable(_field_value(backend, field.name))
        ]
        refusal = backend.refusal(call)
        print(f"  {name}: " + "; ".join(fields))
        print(f"    {example}: " + ("runs" if refusal is None else f"refused ({refusal.reason})"))
    try:
        print(f"'auto' picks {registry.select(call).name} for {example}")
    except (ValueError, TypeError) as error:
        print(f"'auto' picks none for {example}: {error}")
    print(f"MSA per-token selection here: {_selection_kernel(device)}")
    return 0


def _selection_kernel(device: torch.device) -> str:
    """Which kernel select_tokens runs on `device` for bench_msa's proxies (bf16, 4 proxy
    heads, D_p 128, kv_block 128, top_k 16, no documents), and where the other one runs."""
    from flash_msa import _env
    from flash_msa.msa import token_selection_gluon

    proxies = torch.empty(1, 128, 4, 128, dtype=torch.bfloat16, device=device)
    if token_selection_gluon.supports(proxies, 128, 16, documents=False, q_blocks=False):
        return ("gluon (sm_90; documents, q_blocks, kv_block other than 128, D_p other than 64 "
                f"and 128 or top_k over {token_selection_gluon.MAX_KEPT} take the triton "
                "kernel)")  # fmt: skip
    if device.type == "cpu" and not _env.interpreting():
        return "none (triton needs CUDA or TRITON_INTERPRET=1; the gluon kernel an sm_90 GPU)"
    return "triton (the gluon kernel runs on sm_90 GPUs)"


def bench(args: argparse.Namespace) -> int:
    """flash-msa, FlexAttention and SDPA side by side on the standard layouts: a table on the
    terminal and bench.json, bench.md and bench.png in --out."""
    import json
    import pathlib

    from tqdm.auto import tqdm

    from flash_msa import bench as benchmark

    benchmark.pyplot()  # a missing matplotlib ends the command before any measurement
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    sizes = BENCH_GPU_SIZES if on_gpu else BENCH_CPU_SIZES
    seq_len, heads, head_dim = (
        sizes[name] if getattr(args, name) is None else getattr(args, name)
        for name in ("seq_len", "heads", "head_dim")
    )
    dtype = sizes["dtype"] if args.dtype is None else BENCH_DTYPES[args.dtype]
    kv_heads = heads if args.kv_heads is None else args.kv_heads
    if heads % kv_heads != 0:
        raise ValueError(f"heads {heads} must be a multiple of kv_heads {kv_heads} (GQA)")
    modes = ("fwd", "fwd_bwd") if args.mode == "both" else (args.mode,)
    backend = "auto" if on_gpu else "torch"
    run = dict(
        benchmark.device_metadata(device), seq_len=seq_len, heads_q=heads, heads_kv=kv_heads,
        head_dim=head_dim, dtype=str(dtype).removeprefix("torch."), batch=1, causal=True,
        flash_msa_backend=backend, modes=list(modes),
    )  # fmt: skip
    print(
        f"flash-msa bench on {run['device']}: S={seq_len}, H_q={heads}, H_kv={kv_heads}, "
        f"D={head_dim}, {run['dtype']}, causal, flash-msa backend {backend!r}"
    )
    inputs = benchmark.random_inputs(
        seq_len, heads, kv_heads, device, head_dim=head_dim, dtype=dtype
    )
    records = []
    with tqdm(total=len(args.layouts) * len(benchmark.IMPLS), unit="case") as bar:
        for name in args.layouts:
            case = benchmark.build_case(name, seq_len, device)
            flops = case.flops(heads, head_dim)
            calls, reference = benchmark.implementations(case, *inputs[:3], backend=backend), None
            for impl in benchmark.IMPLS:
                bar.set_description(f"{name} {impl}")
                record, out = benchmark.measure(
                    calls, impl, inputs, modes=modes, flops=flops, reference=reference
                )
                reference = out if impl == "flash_msa" else reference
                records.append(dict(layout=name, impl=impl, density=case.layout.density, **record))
                bar.update()
    benchmark.speedups(records)
    table = _bench_table(records, modes)
    print("\n".join(table))
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(dict(run=run, records=records), indent=1))
    notes = [
        "TFLOP/s over the computed pairs, the same count for every implementation (the "
        "layout's active blocks; dense causal and documents: half of each square), "
        f"{FWD_BWD_NOTE}; speed-up: the peer's ms over flash-msa's (above 1x flash-msa is "
        "faster).",
        "",
        *(f"- {impl}: {text}" for impl, text in benchmark.IMPLS.items()),
    ]
    title = (
        f"{run['device']}, {run['dtype']}, S={seq_len}, H_q={heads}, H_kv={kv_heads}, "
        f"D={head_dim}, causal"
    )
    (out_dir / "bench.md").write_text("\n".join([f"# {title}", "", *table, "", *notes]) + "\n")
    panels = {
        MODE_NAMES[mode]: {
            impl: [r.get(f"{mode}_tflops", 0) for r in records if r["impl"] == impl]
            for impl in benchmark.IMPLS
        }
        for mode in modes
    }  # mode -> impl -> TFLOP/s per layout (0: not timed)
    benchmark.write_chart(
        out_dir / "bench.png", list(args.layouts),
        {mode: {impl: values for impl, values in series.items() if any(values)}
         for mode, series in panels.items()},
        ylabel="TFLOP/s over the computed pairs", title=title,
    )  # fmt: skip
    print(f"wrote {out_dir / 'bench.json'}, bench.md, bench.png")
    return 0


MODE_NAMES = {"fwd": "forward", "fwd_bwd": "forward + backward"}
FWD_BWD_NOTE = "forward + backward counted as 3.5x the forward"
# Defaults of flash-msa bench where the option is not given: on a GPU, and the CPU's small size.
BENCH_GPU_SIZES = dict(seq_len=32 * 1024, heads=16, head_dim=128, dtype=torch.bfloat16)
BENCH_CPU_SIZES = dict(seq_len=1024, heads=4, head_dim=64, dtype=torch.float32)
BENCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _rate(tflops: float) -> str:
    """TFLOP/s to one decimal, or three significant digits below 1 (the CPU's)."""
    return f"{tflops:.1f}" if tflops >= 1 else f"{tflops:.3g}"


def _bench_table(records: list[dict], modes: tuple[str, ...]) -> list[str]:
    """Markdown lines, columns padded to line up on a terminal: per record its ms, TFLOP/s and
    (a peer's) flash-msa's speed-up over it in each mode; a skipped or failed record points to
    its reason, listed under the table."""
    header = ["layout", "impl"]
    for mode in modes:
        header += [f"{mode} ms", f"{mode} TFLOP/s", f"{mode} speed-up"]
    rows, reasons = [header], {}  # reason -> its number
    for record in records:
        cells = [record["layout"], record["impl"]]
        reason = record.get("skipped") or record.get("error")
        if reason is not None:
            word = "skipped" if "skipped" in record else "failed"
            number = reasons.setdefault(f"{word}: {reason}", len(reasons) + 1)
            rows.append([*cells, f"{word} [{number}]", *["-"] * (len(header) - 3)])
            continue
        for mode in modes:
            speedup = record.get(f"{mode}_speedup")
            cells += [
                f"{record[f'{mode}_ms']:.3f}", _rate(record[f"{mode}_tflops"]),
                "-" if speedup is None else f"{speedup:.2f}x",
            ]  # fmt: skip
        rows.append(cells)
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    lines = [
        "| " + " | ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) + " |"
        for row in rows
    ]
    lines.insert(1, "|" + "|".join("-" * (width + 2) for width in widths) + "|")
    notes = [f"[{number}] {reason}" for reason, number in reasons.items()]
    return lines + ["", *notes] if notes else lines


def _lengths(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated token counts, 'k' for 1024 ('2k,32k')."""
    lengths = []
    for item in text.split(","):
        item = item.strip().lower()
        try:
            lengths.append(int(item[:-1]) * 1024 if item.endswith("k") else int(item))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{item!r} is not a token count: write e.g. 2048 or 2k, comma-separated"
            ) from None
    return tuple(lengths)


def _fractions(text: str) -> tuple[float, ...]:
    """An argparse type: comma-separated fractions ('0,0.5,1')."""
    try:
        return tuple(float(item) for item in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a list of fractions: write e.g. 0,0.25,0.5,0.75,1"
        ) from None


NIAH_INCOMPLETE = 75  # EX_TEMPFAIL: --max-minutes ran out; the same command resumes


def niah(args: argparse.Namespace) -> int:
    """Train and evaluate the needle benchmark's variants; see flash_msa.niah."""
    import os
    import pathlib

    from flash_msa.niah.suite import TINY, build_configs, run_suite

    model, needles, train, grid = build_configs(
        tiny=args.tiny, layers=args.layers, dim=args.dim, heads=args.heads,
        kv_heads=args.kv_heads, checkpointing=args.activation_checkpointing or None,
        steps=args.steps, train_len=args.train_len, batch=args.batch, seed=args.seed,
        context_lens=args.context_lens, depths=args.depths, samples=args.samples,
    )  # fmt: skip
    default = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    device = torch.device(args.device or default)
    done = run_suite(
        [variant.strip() for variant in args.variants.split(",")], model_config=model,
        needles=needles, train_config=train, grid=grid, device=device,
        checkpoint_dir=pathlib.Path(args.checkpoint_dir), out_dir=pathlib.Path(args.out),
        max_minutes=args.max_minutes, timing_repeats=TINY["timing_repeats"] if args.tiny else 5,
        data_workers=min(4, os.cpu_count() or 1) if device.type == "cuda" else 0,
    )  # fmt: skip
    return 0 if done else NIAH_INCOMPLETE


def _block_size(name: str):
    """An argparse type: an int block size in BLOCK_SIZES, or an error naming the option."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{name} must be an int number of tokens, got {text!r}"
            ) from None
        if value not in BLOCK_SIZES:
            raise argparse.ArgumentTypeError(
                f"{name} {value} is not one of {BLOCK_SIZES}; 64 or 128 run fastest"
            )
        return value

    return parse


def _with_default(text: str, default) -> str:
    return text if "default:" in text else f"{text} (default: {default})"


def _add_builder_options(parser: argparse.ArgumentParser, builder) -> None:
    """One option per builder parameter: --seq-len, --window, --causal/--no-causal, ..."""
    docs = _argument_docs(builder)
    for name, parameter in inspect.signature(builder).parameters.items():
        if name in NOT_OPTIONS:
            continue
        flag = "--" + name.replace("_", "-")
        text = OPTION_HELP.get(name) or docs.get(name) or name.replace("_", " ")
        kind = _block_size(name) if name in ("block_size", "q_block", "kv_block") else int
        if isinstance(parameter.default, bool):
            action = parser.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, default=parameter.default
            )
            # Set after construction: some Pythons' BooleanOptionalAction append their own.
            action.help = f"{text} (default: {'--' if parameter.default else '--no-'}{flag[2:]})"
        elif parameter.default is inspect.Parameter.empty:
            default = 4096 if name == "seq_len" else None
            parser.add_argument(
                flag, dest=name, type=kind, default=default, required=default is None,
                help=f"{text} (required)" if default is None else _with_default(text, default),
            )  # fmt: skip
        else:
            parser.add_argument(
                flag, dest=name, type=kind, default=parameter.default,
                help=_with_default(text, parameter.default),
            )  # fmt: skip


def _argument_docs(builder) -> dict[str, str]:
    """name -> first line of its entry under Args: in the builder's docstring (a fallback
    for parameters OPTION_HELP does not describe)."""
    docs, inside = {}, False
    for line in (inspect.getdoc(builder) or "").splitlines():
        inside = inside or line.strip() == "Args:"
        name, colon, text = line.strip().partition(":")
        if inside and colon and line.startswith("    ") and not line.startswith("        "):
            docs[name] = text.strip().rstrip(".").replace("`", "")
    return docs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flash-msa", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo_help = "run forward + backward on a sliding window + global tokens layout and check it"
    demo_parser = commands.add_parser("demo", help=demo_help, description=demo_help + ".")
    demo_parser.add_argument(
        "--seq-len", type=int, default=None,
        help="sequence length in tokens (default: 16384 on a GPU, 2048 on the CPU)",
    )  # fmt: skip
    demo_parser.add_argument(
        "--block-size", type=_block_size("block_size"), default=128,
        help=f"block size in tokens, one of {BLOCK_SIZES} (default: 128)",
    )  # fmt: skip
    demo_parser.add_argument(
        "--seed", type=int, default=0, help="seed of the random inputs (default: 0)"
    )
    demo_parser.add_argument(
        "--cpu", action="store_true", help="run on the CPU even when a GPU is present"
    )
    demo_parser.set_defaults(run=demo, parser=demo_parser)
    show_help = "draw a pattern: ASCII, or a PNG with --out"
    show_parser = commands.add_parser("show", help=show_help, description=show_help + ".")
    builders = show_parser.add_subparsers(dest="pattern", required=True, metavar="PATTERN")
    for name, description in SHOWABLE.items():
        builder = getattr(patterns, name)
        sub = builders.add_parser(name, help=description, description=description + ".")
        _add_builder_options(sub, builder)
        sub.add_argument(
            "--out", default=None, metavar="PATH", type=_png_path,
            help="write a PNG picture to PATH (a .png file) instead of printing ASCII "
            "(needs matplotlib: pip install 'flash-msa[plot]')",
        )  # fmt: skip
        sub.add_argument(
            "--max-blocks", type=int, default=32,
            help="blocks drawn per side of the ASCII picture (default: 32)",
        )  # fmt: skip
        sub.set_defaults(run=show, parser=sub)
    info_help = "print the versions, the device, the Triton interpreter and the backends"
    info_parser = commands.add_parser("info", help=info_help, description=info_help + ".")
    info_parser.set_defaults(run=info, parser=info_parser)
    _add_bench_parser(commands)
    _add_niah_parser(commands)
    return parser


def _bench_length(text: str) -> int:
    """An argparse type: a token count of at least one block of 128, 'k' / 'm' suffixes."""
    from flash_msa.bench import parse_length

    try:
        value = parse_length(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if value < 128:
        raise argparse.ArgumentTypeError(
            f"seq_len must be at least 128 tokens (one block of the layouts), got {value}"
        )
    return value


def _positive(name: str):
    """An argparse type: a positive int, or an error naming the option."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be a positive int, got {text!r}")
        return value

    return parse


def _folder(text: str) -> str:
    """An argparse type: a folder the command can make or write into (checked now, so that a
    bad path fails before the work, not after it; made only when something is written)."""
    import os
    import pathlib

    path = pathlib.Path(text).absolute()
    existing = next(folder for folder in (path, *path.parents) if folder.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        what = "is not a folder" if not existing.is_dir() else "is not writable"
        raise argparse.ArgumentTypeError(f"cannot write into folder {text!r}: {existing} {what}")
    return text


def _png_path(text: str) -> str:
    """An argparse type: a .png file whose folder exists."""
    import pathlib

    path = pathlib.Path(text)
    if path.suffix.lower() != ".png" or path.is_dir() or not path.parent.is_dir():
        raise argparse.ArgumentTypeError(
            f"--out must name a .png file in an existing folder, got {text!r}"
        )
    return text


def _device(text: str) -> str:
    """An argparse type: "cpu", or "cuda" / "cuda:N" where a GPU is present."""
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"device must be cpu or cuda[:N], got {text!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"device {text!r}: this machine has no CUDA GPU")
    return text


def _minutes(text: str) -> float:
    """An argparse type: a finite number of minutes >= 0 (0: stop after one step)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"max_minutes must be a number >= 0, got {text!r}")
    return value


def _layout_names(text: str) -> tuple[str, ...]:
    """An argparse type: comma-separated names of flash_msa.bench.LAYOUTS."""
    names = tuple(name.strip() for name in text.split(","))
    unknown = [name for name in names if name not in BENCH_LAYOUTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown layouts {unknown}: choose among {', '.join(BENCH_LAYOUTS)}, comma-separated"
        )
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"layouts must be distinct, got {text!r}")
    return names


def _add_bench_parser(commands) -> None:
    bench_help = "time flash-msa against FlexAttention and SDPA on standard layouts"
    cpu = BENCH_CPU_SIZES
    bench_parser = commands.add_parser(
        "bench", help=bench_help,
        description=bench_help + ": a table on the terminal (ms, TFLOP/s over the computed "
        "pairs, flash-msa's speed-up over each peer) and bench.json, bench.md and bench.png "
        "in --out. Batch 1, causal, blocks of 128. FlexAttention runs the same blocks and "
        "element masks (a BlockMask, compiled); SDPA dense causal through cuDNN or flash for "
        "the causal layout, else a dense boolean mask of the same pairs where it fits in "
        "memory. Without a CUDA device the same cases run on the CPU at a small size "
        f"(S={cpu['seq_len']}, H={cpu['heads']}, D={cpu['head_dim']}, float32, where the "
        "window and top-k layouts keep every causal block): flash-msa's torch backend "
        "against SDPA, FlexAttention skipped. Needs matplotlib for the chart "
        "(pip install 'flash-msa[plot]').",
    )  # fmt: skip
    add = bench_parser.add_argument
    gpu = BENCH_GPU_SIZES
    add(
        "--seq-len", type=_bench_length, default=None,
        help=f"tokens, k = 1024, m = 1024^2 (default: {gpu['seq_len'] // 1024}k on a GPU, "
        f"{cpu['seq_len']} on the CPU)",
    )  # fmt: skip
    for name, text in (("heads", "query heads"), ("head_dim", "head dim")):
        add(
            "--" + name.replace("_", "-"), type=_positive(name), default=None,
            help=f"{text} (default: {gpu[name]} on a GPU, {cpu[name]} on the CPU)",
        )  # fmt: skip
    add(
        "--kv-heads", type=_positive("kv_heads"), default=None,
        help="key/value heads, a divisor of --heads (GQA) (default: --heads)",
    )  # fmt: skip
    add(
        "--dtype", choices=tuple(BENCH_DTYPES), default=None,
        help="q, k, v dtype (default: bf16 on a GPU, fp32 on the CPU)",
    )  # fmt: skip
    add(
        "--mode", choices=("fwd", "fwd_bwd", "both"), default="both",
        help="time the forward, forward + backward, or both (default: both)",
    )  # fmt: skip
    add(
        "--layouts", type=_layout_names, default=tuple(BENCH_LAYOUTS),
        help="comma-separated, of "
        + "; ".join(f"{name}: {text}" for name, text in BENCH_LAYOUTS.items())
        + f" (default: {','.join(BENCH_LAYOUTS)})",
    )  # fmt: skip
    add(
        "--out", default="bench-results", metavar="DIR", type=_folder,
        help="folder for bench.json, bench.md and bench.png (default: bench-results)",
    )  # fmt: skip
    bench_parser.set_defaults(run=bench, parser=bench_parser)


def _add_niah_parser(commands) -> None:
    niah_help = (
        "train small Llama models (dense, sliding window, oracle top-k, MSA) on needle "
        "retrieval and write the needle grid"
    )
    niah_parser = commands.add_parser(
        "niah", help=niah_help,
        description=niah_help + ": niah.json, niah.md and niah.png in --out. Resumable: rerun "
        f"the same command to continue; exit status {NIAH_INCOMPLETE} when --max-minutes "
        "stopped it first. Defaults fit an H200 (about 1-2 minutes per variant); --tiny runs "
        "the whole benchmark on the CPU in a minute or so (TRITON_INTERPRET=1 for "
        "oracle_topk and msa).",
    )  # fmt: skip
    add = niah_parser.add_argument
    add(
        "--variants",
        default="dense,window,oracle_topk,msa",
        help="comma-separated variants to run, in order (default: dense,window,oracle_topk,msa)",
    )
    add(
        "--context-lens",
        type=_lengths,
        default=None,
        metavar="LENGTHS",
        help="evaluation context lengths in tokens, comma-separated, k = 1024 "
        "(default: 2k,4k,8k,16k,32k; 64,128 with --tiny)",
    )
    add(
        "--depths",
        type=_fractions,
        default=None,
        help="needle depths, fractions of the haystack, comma-separated "
        "(default: 0,0.1,...,1; 0,1 with --tiny)",
    )
    add(
        "--samples",
        type=int,
        default=None,
        help="evaluation samples per task and grid cell (default: 16; 1 with --tiny)",
    )
    add(
        "--steps",
        type=int,
        default=None,
        help="training steps per variant (default: 2000; 2 with --tiny)",
    )
    add(
        "--train-len",
        type=lambda text: _lengths(text)[0],
        default=None,
        help="longest training length in tokens; training lengths are the powers of two from "
        "32 up to it (default: 32k; 128 with --tiny)",
    )
    add(
        "--batch",
        type=int,
        default=None,
        help="sequences per step at --train-len; shorter steps hold more, so each step trains "
        "BATCH x TRAIN_LEN tokens, in at most 128 sequences (default: 1)",
    )
    add("--layers", type=int, default=None, help="decoder layers (default: 4; 2 with --tiny)")
    add("--dim", type=int, default=None, help="model width (default: 512; 64 with --tiny)")
    add("--heads", type=int, default=None, help="query heads (default: 8; 4 with --tiny)")
    add("--kv-heads", type=int, default=None, help="key/value heads (default: 2)")
    add(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each layer's activations in the backward: less memory, more time",
    )
    add(
        "--seed",
        type=int,
        default=None,
        help="seed of the data, the initial parameters and the grid (default: 0)",
    )
    add(
        "--checkpoint-dir",
        default="niah-checkpoints",
        type=_folder,
        help="checkpoints and per-variant results; reuse it to resume (default: niah-checkpoints)",
    )
    add(
        "--max-minutes",
        type=_minutes,
        default=None,
        help="wall-clock budget of this run: save and stop when spent, resume on the next run "
        "(default: none)",
    )
    add(
        "--out",
        default="niah-results",
        type=_folder,
        help="results directory for niah.json, niah.md and niah.png (default: niah-results)",
    )
    add(
        "--device",
        default=None,
        type=_device,
        help="torch device to train on (default: cuda when present, else cpu; cpu with --tiny)",
    )
    add(
        "--tiny",
        action="store_true",
        help="a tiny model, schedule and grid on the CPU, to check that everything runs",
    )
    niah_parser.set_defaults(run=niah, parser=niah_parser)


def main(argv: list[str] | None = None) -> int:
    """Run the command; a value the library refuses ends like a bad argument: one error line
    after the usage, exit status 2. Running out of GPU memory ends with one error line, exit
    status 1."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, TypeError) as error:
        args.parser.error(str(error))
    except ModuleNotFoundError as error:
        if error.name != "matplotlib":
            raise
        args.parser.error(str(error))
    except torch.OutOfMemoryError as error:
        first_line = str(error).splitlines()[0] if str(error) else "out of memory"
        args.parser.exit(1, f"{args.parser.prog}: error: the GPU ran out of memory "
                            f"({first_line}); pass shorter sequences\n")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
