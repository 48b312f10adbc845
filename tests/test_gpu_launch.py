"""The launch's GPU-only decisions through their CPU twins (issue 38): what NCCL is told on
an emulated node, how a GPU is told apart from another, and what Horovod's GPU build sees.

- Every rank of an emulated node gets NCCL_HOSTID = its namespace, NCCL_SOCKET_IFNAME = its
  veth and InfiniBand off, so NCCL cannot take two "nodes" for one host and go around the
  rate-limited links (tests/test_network.py checks the spawned ranks in real namespaces).
- A GPU is identified by its UUID (else its PCI address), not by its CUDA_VISIBLE_DEVICES
  entry, which is "0" in every task of a site that gives each task a device cgroup.
- install_horovod names the CUDA toolkit as HOROVOD_CUDA_HOME and puts its nvcc on PATH.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from harness.config import ConfigError
from harness.launch import netem
from harness.launch.rank import Seat, gpu_ids, my_seat, placed_devices


def test_each_emulated_nodes_ranks_are_a_host_of_their_own_to_nccl_on_its_veth() -> None:
    net = netem.EmulatedNetwork(hosts=3, rate_mbit=100)  # nothing is made before `with`
    envs = [net.environment(host) for host in range(3)]
    assert [e["NCCL_HOSTID"] for e in envs] == [net.namespace(h) for h in range(3)]
    assert len({e["NCCL_HOSTID"] for e in envs}) == 3
    for env in envs:
        assert env["NCCL_SOCKET_IFNAME"] == f"={netem.IFNAME}"  # that name exactly
        assert env["GLOO_SOCKET_IFNAME"] == netem.IFNAME
        assert (env["NCCL_IB_DISABLE"], env["NCCL_NET"]) == ("1", "Socket")


class _Props:
    def __init__(self, uuid: str, bus: int) -> None:
        self.uuid, self.pci_domain_id, self.pci_bus_id, self.pci_device_id = uuid, 0, bus, 0


@pytest.fixture
def gpus(monkeypatch):
    """This process sees the GPUs given to `see(...)` (faked), each by its properties."""
    def see(*props: _Props) -> None:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(props))
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    return see


def test_a_gpu_is_named_by_its_uuid_not_its_visible_devices_entry(gpus, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # a device cgroup per task: always "0"
    gpus(_Props("GPU-5f1c", 0x41))
    seat = my_seat(rank=0, local_rank=0, worker=True, device_type="cuda")
    assert seat.gpus == ("GPU-5f1c",)
    gpus(_Props("", 0x41), _Props("", 0x81))  # no UUID from torch: the PCI address
    assert gpu_ids(2) == ("pci 0000:41:00", "pci 0000:81:00")
    assert my_seat(rank=1, local_rank=0, worker=False, device_type="cuda").gpus == ()


def test_two_tasks_that_each_see_gpu_0_are_two_gpus_when_their_uuids_differ() -> None:
    def seats(first: str, second: str) -> list[Seat]:
        return [Seat(rank=r, host="a", local_rank=r, worker=True, gpus=(g,))
                for r, g in enumerate((first, second))]

    placed = placed_devices(seats("GPU-aaaa", "GPU-bbbb"), workers_per_node=2,
                            device_type="cuda", backend="nccl")
    assert [str(d) for d in placed] == ["cuda:0", "cuda:0"]  # each its task's only GPU
    with pytest.raises(ConfigError, match="ranks 0 and 1 would share GPU GPU-aaaa of host a"):
        placed_devices(seats("GPU-aaaa", "GPU-aaaa"), workers_per_node=2, device_type="cuda",
                       backend="nccl")


def test_horovods_gpu_build_finds_the_toolkit_by_every_name_it_reads(monkeypatch,
                                                                      tmp_path) -> None:
    from harness import install_horovod as inst

    toolkit = tmp_path / "cuda-13.0"
    (toolkit / "bin").mkdir(parents=True)
    nvcc = toolkit / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    monkeypatch.setattr(inst, "cuda_toolkit", lambda: toolkit)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.delenv("HOROVOD_CUDA_HOME", raising=False)
    env = inst.build_env("13.0")
    for name in ("CUDA_HOME", "HOROVOD_CUDA_HOME", "CUDAToolkit_ROOT"):
        assert env[name] == str(toolkit), name
    assert env["CUDACXX"] == str(nvcc)
    assert shutil.which("nvcc", path=env["PATH"]) == str(nvcc)
    assert env["PATH"].endswith(":/usr/bin:/bin")
    assert "HOROVOD_CUDA_HOME" not in inst.build_env(None)  # a CPU torch: no toolkit
    assert inst.build_env(None)["PATH"] == "/usr/bin:/bin"
