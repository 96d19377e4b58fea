"""A trainer that stalls in the middle of a gloo broadcast, for tests that kill it there.

``python -m harness.stalled_trainer ADDRESS VERSION TIMEOUT`` attaches to the coordinator and
broadcasts three tensors, one bucket each, as ``VERSION`` with the update deadline ``TIMEOUT``.
The first bucket is sent whole; the second bucket's ``WeightBucket`` is sent (the engines wait in
its broadcast) and then the trainer blocks instead of broadcasting, after printing ``stalled in
bucket 1``. The test kills it there: an update in flight whose trainer is gone.
"""

from __future__ import annotations

import sys
import threading

import torch

from common import weight_group
from coordinator.client import RolloutClient


def main(address: str, version: int, timeout: float) -> None:
    broadcast = weight_group.broadcast
    calls = []

    def stalling(group, tensors, timeout_s=None):
        calls.append(len(tensors))
        if len(calls) > 1:
            print(f"stalled in bucket {len(calls) - 1}", flush=True)
            threading.Event().wait()  # until killed
        return broadcast(group, tensors, timeout_s)

    weight_group.broadcast = stalling
    client = RolloutClient(address, timeout=60, retry_interval=0.5)
    print(f"attached as {client._async.client_id}", flush=True)
    tensors = {f"layer{i}.weight": torch.full((256,), float(version + i)) for i in range(3)}
    client.update_weights(tensors, version, backend="gloo", bucket_bytes=1, timeout=timeout)
    print("the update finished: it was meant to stall", flush=True)
    sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
