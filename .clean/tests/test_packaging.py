import warnings

import pytest
import torch

from flash_msa import _env, block_sparse_attn_func, patterns

tomllib = pytest.importorskip("tomllib")


def project():
    from pathlib import Path

    return tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]


def test_a_plain_install_gets_a_numpy_the_interpreter_runs_with():
    assert "numpy<2.4" in project()["dependencies"]  # Triton 3.6's interpreter fails on 2.4


@pytest.mark.skipif(not _env.interpreting(), reason="runs the Triton interpreter")
def test_interpreted_kernels_warn_nothing():
    q, k, v = (torch.randn(1, 64, 1, 16) for _ in range(3))
    with warnings.catch_warnings(record=True) as caught:  # pytest's filters stay in force
        block_sparse_attn_func(q, k, v, patterns.causal(64, block_size=16), backend="triton")
    assert [str(warning.message) for warning in caught] == []
