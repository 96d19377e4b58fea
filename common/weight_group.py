"""The trainer's end of a weight-update group: rank 0 of the group every engine rank joins.

SGLang forms its side with ``init_custom_process_group``: a TCP rendezvous on
``tcp://master_address:master_port``, then a process group whose store keys are prefixed with
the group's name. A trainer that called plain ``torch.distributed.init_process_group`` would put
its keys under the default group's prefix and never meet the engines (the call times out), so
rank 0 forms the group the same way (as slime does): a TCP store for the rendezvous, then
``_new_process_group_helper`` with ``PrefixStore(group_name, store)``. Rank 0 serves the store
(``host``) apart from its own client connection (``join``), so the caller can close it while ranks
wait on it: a group that can no longer form (an engine died in the rendezvous, the coordinator
aborted the update) then fails at once on every rank, instead of each one waiting out its timeout.
The sim engine mirrors SGLang's layout, so what works against it works against SGLang.

With ``backend="nccl"`` the tensors live on the trainer's GPU and every engine rank on its own GPU.
NCCL cannot tell that a peer died: a collective waits for it. ``broadcast`` therefore waits on each
send with the update's timeout, which blocks this thread and raises (after aborting the communicator)
when it passes; the group's own NCCL timeout, which its watchdog enforces by ending the process, is set
``NCCL_WATCHDOG_MARGIN_S`` later, so the trainer gets the error rather than losing its process.

torch is imported only when a group is formed: everything else in rollfleet runs without it.
Every call here blocks; run them off the event loop.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Any

DEFAULT_GROUP_NAME = "weight_update_group"
NCCL_WATCHDOG_MARGIN_S = 60.0


def host(master_address: str, master_port: int, timeout_s: float = 300.0) -> Any:
    """The group's rendezvous store, served by this process at ``tcp://master_address:master_port``;
    returns at once. Every rank, this process's own ``join`` included, meets on it as a client. Drop
    the last reference to close it: every rank still waiting on it (an engine in
    ``/init_weights_update_group``, a ``join`` in another thread) fails at once instead of at its
    timeout. Keep it for as long as the group lives."""
    from torch.distributed import TCPStore

    return TCPStore(master_address, master_port, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)


def join(
    master_address: str,
    master_port: int,
    world_size: int,
    *,
    backend: str = "nccl",
    group_name: str = DEFAULT_GROUP_NAME,
    timeout_s: float = 300.0,
) -> Any:
    """Join the group as rank 0 through a store that ``host`` serves; the process group once every
    engine rank joined."""
    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.distributed_c10d import _new_process_group_helper, _world

    timeout = timedelta(seconds=timeout_s)
    store = TCPStore(master_address, master_port, world_size, False, timeout)
    # NCCL's watchdog ends the process when an operation outlives the group's timeout: let
    # ``broadcast``'s own wait (same timeout as the store's) raise first.
    op_timeout = timedelta(seconds=timeout_s + NCCL_WATCHDOG_MARGIN_S) if backend == "nccl" else timeout
    group, _ = _new_process_group_helper(
        world_size, 0, [], backend, PrefixStore(group_name, store), group_name=group_name, timeout=op_timeout
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


_hosted: dict[int, Any] = {}
"""Stores ``join_as_trainer`` hosted, by the id of their group, kept until ``destroy``."""


def join_as_trainer(
    master_address: str,
    master_port: int,
    world_size: int,
    *,
    backend: str = "nccl",
    group_name: str = DEFAULT_GROUP_NAME,
    timeout_s: float = 300.0,
) -> Any:
    """``host`` and ``join`` in one call, the store kept with the group (for a caller that never needs to
    close the rendezvous early)."""
    store = host(master_address, master_port, timeout_s)
    group = join(master_address, master_port, world_size, backend=backend, group_name=group_name, timeout_s=timeout_s)
    _hosted[id(group)] = store
    return group


def broadcast(group: Any, tensors: Iterable[Any], timeout_s: float | None = None) -> None:
    """Send each tensor from rank 0 to every engine rank, in order (the order of the bucket's names).

    Returns once every send completed (for CUDA tensors too, whose collectives run on NCCL's stream);
    raises if one fails or, with ``timeout_s``, outlives it."""
    import torch.distributed as dist

    works = [dist.broadcast(tensor, src=0, group=group, async_op=True) for tensor in tensors]
    timeout = timedelta(seconds=timeout_s) if timeout_s else None
    for work in works:
        # An explicit timeout makes NCCL's wait block this thread until the send is done (or raise).
        work.wait(timeout) if timeout is not None else work.wait()


def destroy(group: Any) -> None:
    """Tear the trainer's end of the group down (the engines' ends go with /destroy_weights_update_group).

    An NCCL group is aborted, not shut down: a shutdown may wait on its peers, and a group is often
    dropped because one of them died."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if dist.get_backend(group) == "nccl" and hasattr(distributed_c10d, "_abort_process_group"):
        distributed_c10d._abort_process_group(group)
    else:
        dist.destroy_process_group(group)
    _hosted.pop(id(group), None)
