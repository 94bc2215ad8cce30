"""The default group's backend and the side-channel tensors' device come from flexdemo.devices.

No process starts and no GPU is needed: the visible device count is injected, and the groups are
fakes that list the device types they have a backend for, as a ProcessGroup does, and refuse a
tensor on any other device, as torch does ("No backend type associated with device type cpu").
A CUDA-only group is played by a meta-only one: meta tensors can be made without a GPU, and
reading one back fails, so each run below ends at its first read after the collectives.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import flexdemo.devices as devices
from experiments import cli
from experiments.config import RunConfig
from experiments.errors import ConfigError
from experiments.run import launch, train
from flexdemo.consensus import replica_spread
from flexdemo.devices import MIXED, backend_for, side_channel_device
from flexdemo.replicators.sampled_spread import SampledSpread
from flexdemo.wire import CommStats

META_ONLY = r"Tensor\.item\(\) cannot be called on meta tensors|Cannot copy out of meta tensor"


class WrongDevice(Exception):
    """A tensor handed to a group with no backend for its device (not a RuntimeError)."""


class FakeGroup:
    """A group of ``size`` identical ranks with backends for ``types``."""

    def __init__(self, types: list[str], size: int = 2) -> None:
        self._device_types = [torch.device(t) for t in types]
        self.size = size


class Recorder:
    """Stands in for torch.distributed's collectives: records each tensor's device, checks it."""

    def __init__(self, default: FakeGroup) -> None:
        self.default = default
        self.devices: list[str] = []

    def _cross(self, tensor: torch.Tensor, group: FakeGroup | None) -> None:
        group = group or self.default
        self.devices.append(tensor.device.type)
        if tensor.device.type not in {d.type for d in group._device_types}:
            raise WrongDevice(f"No backend type associated with device type {tensor.device.type}")

    def all_reduce(self, tensor: torch.Tensor, op: object = None, group: FakeGroup | None = None,
                   async_op: bool = False) -> None:
        """An all-reduce over identical ranks: a sum multiplies by their count, MIN keeps."""
        self._cross(tensor, group)
        if op is None or op == dist.ReduceOp.SUM:
            tensor.mul_((group or self.default).size)

    def all_gather(self, parts: list[torch.Tensor], tensor: torch.Tensor,
                   group: FakeGroup | None = None, async_op: bool = False) -> None:
        """Every rank sent this rank's tensor."""
        self._cross(tensor, group)
        for part in parts:
            part.copy_(tensor)

    def get_world_size(self, group: FakeGroup | None = None) -> int:
        """The fake group's size."""
        return (group or self.default).size


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch):
    """Patches the collectives; ``recorder.default`` is the default group, CUDA-only (meta)."""
    rec = Recorder(FakeGroup(["meta"]))
    monkeypatch.setattr(dist, "all_reduce", rec.all_reduce)
    monkeypatch.setattr(dist, "all_gather", rec.all_gather)
    monkeypatch.setattr(dist, "get_world_size", rec.get_world_size)
    monkeypatch.setattr(devices, "_default_group", lambda: rec.default)
    return rec


@pytest.mark.parametrize("requested, cuda, local, expected", [
    ("auto", 0, 1, "gloo"), ("auto", 0, 4, "gloo"), ("gloo", 0, 4, "gloo"),
    ("auto", 4, 4, MIXED), ("auto", 4, 2, MIXED), ("nccl", 4, 4, MIXED), ("gloo", 4, 4, "gloo"),
    ("auto", 4, 8, "gloo"),  # fewer GPUs than local ranks: they would share devices
])
def test_the_backend_comes_from_the_visible_devices(requested, cuda, local, expected):
    assert backend_for(requested, cuda, local) == expected


def test_nccl_without_a_gpu_is_refused_in_one_sentence():
    with pytest.raises(ValueError, match="needs a CUDA device and none is visible"):
        backend_for("nccl", 0, 1)
    with pytest.raises(ValueError, match="backend must be one of"):
        backend_for("mpi", 4, 1)


@pytest.mark.parametrize("cuda, expected", [(0, "gloo"), (4, MIXED)])
def test_the_launcher_asks_the_helper(monkeypatch, cuda, expected):
    monkeypatch.setattr(launch, "visible_cuda_devices", lambda: cuda)
    assert launch._backend(RunConfig(nodes=2, gpus_per_node=2), 4) == expected


def test_the_launcher_refuses_nccl_without_a_gpu_as_a_config_error(monkeypatch):
    monkeypatch.setattr(launch, "visible_cuda_devices", lambda: 0)
    with pytest.raises(ConfigError, match="none is visible here"):
        launch._backend(RunConfig(backend="nccl"), 1)


def test_run_with_nccl_and_no_gpu_exits_2_and_writes_nothing(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(launch, "visible_cuda_devices", lambda: 0)
    out = tmp_path / "out"
    argv = ["run", "--method", "demo", "--workload", "lm-tiny", "--backend", "nccl",
            "--steps", "1", "--out", str(out)]
    assert cli.main(argv) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("types, preferred, expected", [
    ([], None, "cpu"), (["cpu"], None, "cpu"), (["cpu", "cuda"], None, "cpu"),
    (["cuda"], None, "cuda"), (["cuda"], "cpu", "cuda"), (["cpu", "cuda"], "cuda", "cuda"),
    (["cpu"], "cuda", "cpu"),
])
def test_the_side_channel_device_is_one_the_group_has_a_backend_for(types, preferred, expected):
    assert side_channel_device(FakeGroup(types), preferred).type == expected


def test_the_default_group_is_asked_when_none_is_given(recorder):
    assert side_channel_device().type == "meta"
    recorder.default = FakeGroup(["cpu", "cuda"])
    assert side_channel_device().type == "cpu"


class _Workload:
    def loss(self, model: torch.nn.Module, batch: object) -> torch.Tensor:
        return torch.tensor(2.0)


def test_evaluation_and_divergence_cross_a_cuda_only_default_group_on_its_device(recorder):
    with pytest.raises(RuntimeError, match=META_ONLY):
        train._evaluate(torch.nn.Linear(2, 2), _Workload(), [None], math.inf)
    assert recorder.devices == ["meta", "meta"]  # the loss, then the first bad step


def test_evaluation_stays_on_the_cpu_where_the_group_has_gloo(recorder):
    recorder.default = FakeGroup(["cpu", "cuda"], size=1)
    assert train._evaluate(torch.nn.Linear(2, 2), _Workload(), [None], 7.0) == (2.0, 7.0)
    assert recorder.devices == ["cpu", "cpu"]


def test_replica_spread_crosses_cuda_only_groups_on_their_device(recorder):
    params = [torch.ones(3), torch.zeros(2)]
    with pytest.raises(RuntimeError, match=META_ONLY):
        replica_spread(params, FakeGroup(["meta"]), FakeGroup(["meta"]))
    assert recorder.devices == ["meta", "meta"]  # the shards' mean, then the three totals


def test_replica_spread_keeps_cpu_shards_on_a_group_with_gloo(recorder):
    both = FakeGroup(["cpu", "cuda"])
    assert replica_spread([torch.ones(3)], both, both) == (0.0, 0.0)
    assert recorder.devices == ["cpu", "cpu"]


def test_adas_probe_crosses_cuda_only_groups_on_their_device(recorder):
    params = [torch.arange(6.0)]
    probe = SampledSpread(params, sample=4)
    with pytest.raises(RuntimeError, match=META_ONLY):
        probe.measure(params, FakeGroup(["meta"]), 2, FakeGroup(["meta"]), CommStats())
    assert recorder.devices == ["meta", "meta"]  # the replicate group's, then the node's
