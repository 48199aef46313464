"""The Gluon kernels on proxy_walk_gluon.py's walk (per-token selection, block scores) compile
for sm_90 without a GPU."""

import pytest

KERNELS = ("token_selection_gluon", "block_scores_gluon")

COMPILE = """
import importlib, json, sys
kernel = importlib.import_module(f"flash_msa.msa.{sys.argv[2]}")
for scores, proxy_dim in (("bf16", 128), ("fp8e4nv", 128), ("fp16", 64)):
    report = kernel.compile_for_sm90(sys.argv[1], scores, proxy_dim)
    print(json.dumps(dict(report, name=f"{scores} D_p {proxy_dim}")))
"""


@pytest.mark.parametrize("kernel", KERNELS)
def test_walk_kernels_compile_for_hopper(sm90, kernel):
    """Warp-specialised (setmaxnreg), on warpgroup MMAs, without spills, and each product in
    flight while the consumer takes the row maxima of the block before (between a product's
    issue and its wait): for selection they then enter the top-k, for block scores a column
    of the run's maxima."""
    reports = sm90(COMPILE, kernel)
    assert len(reports) == 3
    for report in reports:
        assert report["wgmma"] and report["spills"] == 0, report
        assert report["setmaxnreg"] and report["maxima_under_products"] >= 32, report
