"""The chaos suite (bounded): every failure kind while batches flow and weights change, then the invariants of a
quiesced fleet.

Agent, engine, coordinator, gateway and trainer SIGKILLs, a partition of an agent's coordinator link past its TTL
and a node lost for good, each at least once (``harness/chaos.py``; the coordinator runs two gateways), while the
trainer pushes a weight update every 3 batches, disk and gloo broadcast in turn, runs an evaluation pass every 15
batches, and every sample is made in two turns by a generate function with a tool's tokens inserted between them:
half of them with ``engine.generate``, half through the OpenAI client on the agent's endpoint
(``harness.generate_fns:chaos_turns``).
Then: prompt accounting over every state, the ledger against the agents' stores, 0 lost, 0 duplicated, replays
identical, every serving engine on the coordinator's weight version and versions never backwards
(``harness/chaos_check.py``), and each evaluation pass counting every evaluation prompt once
(``harness/chaos_eval.py``). ``scripts/chaos.py``
runs the same thing longer and with other seeds; ``ROLLFLEET_CHAOS_SEED`` and ``ROLLFLEET_CHAOS_BATCHES``
pick this one's.
"""

import importlib.util
import os

import pytest

from harness.chaos import run_chaos

MULTI_TURN = "harness.generate_fns:chaos_turns"


@pytest.mark.chaos
@pytest.mark.timeout(900)
def test_exactly_once_under_every_failure_kind(tmp_path):
    batches = int(os.environ.get("ROLLFLEET_CHAOS_BATCHES", "60"))
    seed = int(os.environ.get("ROLLFLEET_CHAOS_SEED", "1"))
    # Every sample multi-turn: two engine calls with a tool's tokens between them (harness/generate_fns.py), odd
    # samples through the openai client on the agent's OpenAI endpoint.
    # An evaluation pass every 15 batches (harness/chaos_eval.py): each one counts every evaluation prompt once.
    report = run_chaos(tmp_path, batches=batches, seed=seed, weights_every=3, generate=MULTI_TURN, evaluate_every=15)
    assert {kind: report.kills[kind] for kind in report.kinds if report.kills[kind] < 1} == {}, report.actions
    assert report.batches == batches + report.extra_batches  # extra: pulled at quiesce to settle requeued prompts
    assert report.problems == []
    assert report.duplicated == 0 and report.lost == 0
    assert report.replay_mismatches == 0 and report.unaccounted_prompts == 0
    assert report.evaluations >= 1
    assert report.tool_samples > 0  # multi-turn samples reached the trainer, their masks the length of their tokens
    assert report.weight_updates["disk"] >= 1, report.weight_updates
    if importlib.util.find_spec("torch") is not None:  # without torch the trainer pushes disk updates only
        assert report.weight_updates["distributed"] >= 1, report.weight_updates
