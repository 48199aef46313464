"""flash_msa._env: on_tensor_device, the device the kernels launch on."""

import contextlib

import pytest
import torch
from torch._subclasses import fake_tensor

from flash_msa import _env
from flash_msa.msa import msa_func


def _recording_device(monkeypatch) -> list:
    """Replace torch.cuda.device by a context manager that records its device (this machine
    may have no GPU to switch to)."""
    entered = []

    @contextlib.contextmanager
    def device(value):
        entered.append(torch.device(value))
        yield

    monkeypatch.setattr(torch.cuda, "device", device)
    return entered


def test_a_call_on_another_gpus_tensors_runs_with_that_gpu_current(monkeypatch):
    entered = _recording_device(monkeypatch)

    @_env.on_tensor_device
    def launch(scale, tensor, other):
        """Its docstring and name survive."""
        return scale, tensor.device, other

    # A tensor on cuda:1 whatever GPUs there are: FakeTensorMode would otherwise create one on
    # that device first.
    monkeypatch.setattr(fake_tensor, "init_gpu_context", lambda device: None)
    with fake_tensor.FakeTensorMode():
        tensor = torch.empty(4, device="cuda:1")
    assert launch(2.0, tensor, other=None) == (2.0, torch.device("cuda:1"), None)
    assert entered == [torch.device("cuda:1")]
    assert launch.__name__ == "launch" and launch.__doc__.startswith("Its docstring")


def test_a_call_on_cpu_tensors_switches_no_device(monkeypatch):
    entered = _recording_device(monkeypatch)

    @_env.on_tensor_device
    def launch(tensor):
        return tensor.sum()

    assert float(launch(torch.ones(3))) == 3.0
    assert entered == []


@pytest.mark.gpu
def test_kernels_run_on_the_tensors_gpu_whatever_gpu_is_current():
    """With two GPUs: attention and MSA on cuda:1's tensors while cuda:0 is current give what
    they give with cuda:1 current, forward and backward."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    generator = torch.Generator().manual_seed(0)
    shapes = dict(q_proxy=(4, 128), k_proxy=(1, 128), q=(16, 64), k=(4, 64), v=(4, 64))
    inputs = {name: torch.randn(1, 1024, *shape, generator=generator).to("cuda:1", torch.bfloat16)
              for name, shape in shapes.items()}  # fmt: skip

    def run(current: int):
        leaves = {name: tensor.clone().requires_grad_() for name, tensor in inputs.items()}
        with torch.cuda.device(current):
            out, kl_loss = msa_func(*leaves.values(), top_k=4, kv_block=128)
            (out.float().square().mean() + kl_loss).backward()
        return [out, kl_loss, *(tensor.grad for tensor in leaves.values())]

    for got, expected in zip(run(0), run(1), strict=True):
        assert got.device == torch.device("cuda:1") and torch.equal(got, expected)
