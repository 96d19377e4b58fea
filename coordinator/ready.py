"""Ready groups: accepted groups (committed on their agent, recorded READY) waiting for a batch.

Admission adds a group when its receipt is accepted (``add``); batches take them out (``pop``), each
training dataset's in acceptance order, or, under ``--max-staleness``, oldest weights first
(docs/weights.md, staleness rule 2), then acceptance order. A retired agent's ready groups are
taken out and generated again (``take_agent``).

Invariants:
- ``info`` is the truth: a prompt is ready exactly while it has an entry there, and ``count`` holds
  the entries by dataset. A queue may still hold prompts taken out of turn; ``pop`` skips them.
- Acceptance order survives a restart: each entry keeps its sequence number (``PromptState.seq``).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import deque

from coordinator.frontier import READY
from coordinator.prompt_key import dataset_of
from coordinator.records import Prompt, PromptState, PutPrompt

__all__ = ["ReadyGroups"]


class ReadyGroups:
    def __init__(self, datasets: int, oldest_first: bool = False):
        """``datasets``: the training datasets; ``oldest_first``: ``pop`` takes the oldest weights first
        (``--max-staleness``)."""
        self._queues: dict[int, deque[Prompt]] = {}
        """Each training dataset's ready groups in acceptance order (may hold prompts no longer ready)."""
        self.info: dict[Prompt, PromptState] = {}
        """Every ready group by prompt."""
        self.count: list[int] = [0] * datasets
        """Entries of ``info`` by training dataset."""
        self._oldest_first = oldest_first
        self._seq = 0

    def __len__(self) -> int:
        return len(self.info)

    def restore(self, prompts: dict[Prompt, PromptState]) -> None:
        """The ready groups a restarted coordinator found in the ledger, in their acceptance order."""
        for prompt, st in sorted((kv for kv in prompts.items() if kv[1].ready), key=lambda kv: (kv[1].seq, kv[0])):
            if dataset_of(prompt[0]) < len(self.count):
                self._put(prompt, st)
            self._seq = max(self._seq, st.seq)

    def add(self, epoch: int, index: int, agent_id: str, key: str, stats: dict, ops: list, start: int = 0) -> None:
        """A group was accepted; ``start``: weight updates pushed when its lease was granted."""
        self._seq += 1
        st = PromptState(READY, agent_id, key, stats, self._seq, start=start)
        self._put((epoch, index), st)
        ops.append(PutPrompt(epoch, index, st))

    def key_of(self, prompt: Prompt) -> str | None:
        """The group key of ``prompt``'s ready group; None if it has none."""
        st = self.info.get(prompt)
        return None if st is None else st.key

    def _put(self, prompt: Prompt, st: PromptState) -> None:
        dataset = dataset_of(prompt[0])
        self._queues.setdefault(dataset, deque()).append(prompt)
        self.info[prompt] = st
        self.count[dataset] += 1

    def take(self, prompt: Prompt) -> PromptState | None:
        """``prompt``'s ready entry, removed (None if it has none)."""
        st = self.info.pop(prompt, None)
        if st is not None:
            self.count[dataset_of(prompt[0])] -= 1
        return st

    def pop(self, dataset: int) -> tuple[Prompt, PromptState | None]:
        """The next ready group of training dataset ``dataset`` (``count[dataset]`` > 0); its state is None for
        a prompt no longer ready (skip it)."""
        queue = self._queues[dataset]
        if self._oldest_first:
            # Oldest weights first (docs/weights.md, staleness rule 2), then acceptance order.
            mine = (kv for kv in self.info.items() if dataset_of(kv[0][0]) == dataset)
            oldest = min(mine, key=lambda kv: (kv[1].start, kv[1].seq), default=None)
            if oldest is not None:
                self.take(oldest[0])
                if len(queue) > 2 * self.count[dataset] + 64:  # drop the entries popped out of order
                    self._queues[dataset] = deque(prompt for prompt in queue if prompt in self.info)
                return oldest
        prompt = queue.popleft()
        return prompt, self.take(prompt)  # None: reopened after its node was retired

    def fullest(self) -> int:
        """The training dataset with the most ready groups (ties: the earlier)."""
        return max(range(len(self.count)), key=lambda d: (self.count[d], -d))

    def take_agent(self, agent_id: str) -> list[Prompt]:
        """``agent_id``'s ready groups, taken out (the agent was retired: its payloads are gone)."""
        gone = [prompt for prompt, st in self.info.items() if st.agent_id == agent_id]
        for prompt in gone:
            self.take(prompt)
        return gone

    def keys_on(self, agent_id: str) -> set[str]:
        """Keys of ``agent_id``'s ready groups."""
        return {st.key for st in self.info.values() if st.agent_id == agent_id}

    def agents(self) -> set[str]:
        """The agents holding ready groups."""
        return {st.agent_id for st in self.info.values()}

    def starts(self):
        """Each ready group's ``start`` (weight updates pushed when its lease was granted)."""
        return (st.start for st in self.info.values())

    def starts_by_dataset(self) -> dict[int, list[int]]:
        """``starts``, by training dataset."""
        out: dict[int, list[int]] = {}
        for (epoch, _), st in self.info.items():
            out.setdefault(dataset_of(epoch), []).append(st.start)
        return out
