"""A trainer of one process that shards its model with FSDP2 anyway (one GPU, or a mesh of one CPU process): its
parameters are DTensors, and ``update_weights`` sends their full tensors (``client_weights.local_tensors``)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from harness.cluster import free_port  # noqa: E402


def test_a_one_process_fsdp2_models_parameters_are_sent_as_their_full_tensors():
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from coordinator.client_weights import local_tensors

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port('127.0.0.1')}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        plain = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
        expected = {n: p.detach().clone() for n, p in plain.named_parameters()}
        fully_shard(plain)
        sharded = list(plain.named_parameters())
        assert all(hasattr(p, "device_mesh") for _, p in sharded)  # DTensors
        sent = local_tensors((n, p.detach()) for n, p in sharded)
        assert [n for n, _ in sent] == list(expected)
        for name, tensor in sent:
            assert not hasattr(tensor, "device_mesh"), f"{name} is still a DTensor"
            assert torch.equal(tensor, expected[name])
    finally:
        dist.destroy_process_group()
