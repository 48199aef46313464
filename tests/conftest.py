import os

import pytest
import torch
from hypothesis import settings

# Triton kernels run on the CPU through the interpreter; it must be chosen before they compile.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# HYPOTHESIS_PROFILE=long: the property tests run many more cases, fresh ones each run.
settings.register_profile(
    "long", max_examples=2000, deadline=None, database=None, print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run on the GPU machine)")
    config.addinivalue_line(
        "markers", "large_memory: needs most of the GPU's memory (run alone, not in parallel)"
    )
    config.addinivalue_line(
        "markers",
        "on_device: runs on the GPU where there is one (elsewhere through the interpreter or "
        "the torch backend); on a GPU machine every test of a module whose DEVICE is cuda",
    )


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        for item in items:
            if getattr(getattr(item, "module", None), "DEVICE", None) == "cuda":
                item.add_marker(pytest.mark.on_device)
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marked gpu: run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def poisoned_allocations(monkeypatch):
    """Fill every floating buffer the kernels allocate with NaN: unwritten elements fail."""
    # Dynamo maps torch's functions to their tracing rules once per process, from what
    # torch.empty is when it first builds the map: build it before the patch, or a later
    # torch.compile would find no rule for the real torch.empty.
    torch._dynamo.trace_rules.get_torch_obj_rule_map()
    empty, empty_like = torch.empty, torch.empty_like

    def poison(tensor):
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(empty_like(*a, **kw)))


@pytest.fixture
def sm90(tmp_path):
    """flash_msa.testing.sm90_reports(script, *args) in tmp_path; skips where this Triton
    bundles no ptxas."""
    from flash_msa.testing import PTXAS, sm90_reports  # after TRITON_INTERPRET is chosen

    if not os.path.exists(PTXAS):
        pytest.skip("this Triton build bundles no ptxas")

    def run(script: str, *args: str) -> list[dict]:
        return sm90_reports(script, tmp_path, *args)

    return run
