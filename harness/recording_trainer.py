"""A trainer that records every batch it pulls, for tests that SIGKILL it and start it again.

``python -m harness.recording_trainer ADDRESS DIR STEPS`` pulls batches ``0 .. STEPS - 1`` with
``RolloutClient(ADDRESS, record=DIR)`` and prints ``batch N`` once each is in hand (its file is
then being written on the recorder's thread), then ``done`` after ``close()`` wrote everything.
"""

from __future__ import annotations

import sys

from coordinator.client import RolloutClient


def main(address: str, directory: str, steps: int) -> None:
    with RolloutClient(address, record=directory, timeout=60, retry_interval=0.5) as client:
        for step in range(steps):
            client.generate(step)
            print(f"batch {step}", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
