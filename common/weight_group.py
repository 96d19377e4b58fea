"""The trainer's end of a weight-update group: rank 0 of the group every engine rank joins.

SGLang forms its side with ``init_custom_process_group``: a TCP rendezvous on
``tcp://master_address:master_port``, then a process group whose store keys are prefixed with
the group's name. A trainer that called plain ``torch.distributed.init_process_group`` would put
its keys under the default group's prefix and never meet the engines (the call times out), so
rank 0 forms the group the same way (as slime does): ``rendezvous`` for the store, then
``_new_process_group_helper`` with ``PrefixStore(group_name, store)``. The sim engine mirrors
SGLang's layout, so what works against it works against SGLang.

torch is imported only when a group is formed: everything else in rollfleet runs without it.
Every call here blocks; run them off the event loop.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Any

DEFAULT_GROUP_NAME = "weight_update_group"


def join_as_trainer(
    master_address: str,
    master_port: int,
    world_size: int,
    *,
    backend: str = "nccl",
    group_name: str = DEFAULT_GROUP_NAME,
    timeout_s: float = 300.0,
) -> Any:
    """Host the rendezvous as rank 0 and return the process group once every engine rank joined."""
    from torch.distributed import PrefixStore, rendezvous
    from torch.distributed.distributed_c10d import _new_process_group_helper, _world

    timeout = timedelta(seconds=timeout_s)
    store, _, _ = next(rendezvous(f"tcp://{master_address}:{master_port}", 0, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        world_size, 0, [], backend, PrefixStore(group_name, store), group_name=group_name, timeout=timeout
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def broadcast(group: Any, tensors: Iterable[Any]) -> None:
    """Send each tensor from rank 0 to every engine rank, in order (the order of the bucket's names)."""
    import torch.distributed as dist

    for tensor in tensors:
        dist.broadcast(tensor, src=0, group=group)


def destroy(group: Any) -> None:
    """Tear the trainer's end of the group down (the engines' ends go with /destroy_weights_update_group)."""
    import torch.distributed as dist

    dist.destroy_process_group(group)
