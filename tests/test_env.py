"""flash_msa._env: on_tensor_device, the device the kernels launch on."""

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from flash_msa import _env


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

    with FakeTensorMode():  # a tensor on cuda:1 without a GPU
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
