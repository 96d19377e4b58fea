"""One rank of a sharded trainer, driven line by line on stdin, for tests of ranks' shares.

    python -m harness.rank_puller ADDRESS RANK WORLD RUN

Commands (one per line), each answered with one JSON line on stdout:
- ``generate T``: this rank's share of batch ``T``: ``{"rollout_id", "groups": [[epoch, index], ...],
  "lengths": [...], "rewards": [...], "metrics", "rank_lengths", "micro_batches": {budget: count}}``;
- ``pause`` / ``state_dict`` / ``load_state_dict JSON`` (the leader's calls): their answers;
- ``close``: closes the client and exits.
A call that raises answers ``{"error": "<ExceptionType>: <message>"}`` and the process keeps serving.
"""

from __future__ import annotations

import json
import logging
import sys

from coordinator.client import RolloutClient

BUDGETS = (64, 256)


def main(argv: list[str]) -> int:
    address, rank, world, run = argv[0], int(argv[1]), int(argv[2]), argv[3]
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    client = RolloutClient(
        address,
        rank=rank,
        world_size=world,
        run=run,
        timeout=120,
        retry_interval=0.5,
        fetch_timeout=2,
        fetch_deadline=3,
        leader_wait=20,
    )
    print(json.dumps({"ready": client.rank}), flush=True)
    for line in sys.stdin:
        command, _, rest = line.strip().partition(" ")
        try:
            if command == "generate":
                batch = client.generate(int(rest))
                samples = batch.samples
                answer = {
                    "rollout_id": batch.rollout_id,
                    "groups": [[g.data_epoch, g.index] for g in batch.groups],
                    "lengths": [len(s.prompt_tokens) + len(s.response_tokens) for s in samples],
                    "rewards": [s.reward for s in samples],
                    "metrics": batch.metrics,
                    "rank_lengths": batch.rank_lengths,
                    "micro_batches": {n: batch.micro_batch_count(n) for n in BUDGETS},
                }
            elif command == "pause":
                answer = client.pause(drain=True).to_dict()
            elif command == "state_dict":
                answer = client.state_dict()
            elif command == "load_state_dict":
                client.load_state_dict(json.loads(rest))
                answer = {"loaded": True}
            elif command == "close":
                break
            else:
                answer = {"error": f"unknown command {command!r}"}
        except Exception as exc:  # the test reads the failure from the answer
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
