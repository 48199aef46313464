import sys, torch, triton
sys.path.insert(0, "benchmarks")
from common import causal_layout, window_layout, topk_layout, random_inputs
from flash_msa import block_sparse_attn_func
from flash_msa.testing import relative_error
K = 1024
for name, S, build in (("causal-32k", 32 * K, causal_layout), ("window-128k", 128 * K, window_layout), ("topk16-128k", 128 * K, topk_layout)):
    layout = build(S, "cuda")
    q, k, v, dout = random_inputs(S, 16, 16, "cuda")
    flops = layout.flops(128) * 16
    res = {}
    for label, backend, det in (("triton", "triton", True), ("gluon-det", "gluon", True), ("gluon-atomic", "gluon", False)):
        try:
            def run():
                out = block_sparse_attn_func(q, k, v, layout, causal=True, backend=backend, deterministic=det)
                return torch.autograd.grad(out, (q, k, v), dout)
            grads = run()
            res[label] = grads
            fwd = triton.testing.do_bench(lambda: block_sparse_attn_func(q, k, v, layout, causal=True, backend=backend), rep=200)
            ms = triton.testing.do_bench(run, rep=300)
            err = [relative_error(g, r.double()) for g, r in zip(grads, res["triton"])]
            print(f"{name} {label}: fwd {fwd:.3f} ms fwd+bwd {ms:.3f} ms bwd {ms - fwd:.3f} ms ({2.5 * flops / (ms - fwd) / 1e9:.0f} TF/s 5-mm) vs triton {err}", flush=True)
        except Exception as e:
            print(name, label, "FAILED", repr(e)[:400], flush=True)
    del q, k, v, dout, res
    torch.cuda.empty_cache()
