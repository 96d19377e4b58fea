"""The trainer API's records decode the coordinator's answers as they come on the wire (coordinator/client_results.py,
coordinator/client_stats.py): every field typed, the whole answer kept as ``raw``, a key missing (a replay's
fewer keys, an older coordinator) read as its zero, and ``record["key"]`` still answered for one release, with a
``DeprecationWarning``."""

from __future__ import annotations

import json
import pickle

import pytest

from coordinator.client import (
    CoordinatorStats,
    EvalMetrics,
    FleetStats,
    MixtureResult,
    PauseResult,
    ResumeResult,
    WeightUpdateResult,
)
from coordinator.client_stats import AgentInfo, PromptCounts, WeightLock

COUNTS = {"pending": 5, "leased": 2, "ready": 1, "delivered": 8, "filtered": 0}
METRICS = {
    "name": "math",
    "pass": 2,
    "prompts": 4,
    "samples": 8,
    "failed_prompts": 0,
    "n_samples": 2,
    "reward_mean": 0.5,
    "pass@1": 0.5,
    "pass@2": 0.75,
    "response_length_mean": 3.0,
    "truncated_ratio": 0.25,
    "weight_versions": ["3", "default"],
}
STATS = {  # a coordinator's answer to Stats, as coordinator status --json prints it
    "agents": {
        "a1": {
            "status": "alive",
            "capacity": 4,
            "leases": 2,
            "engines": [{"name": "sim-0", "state": "healthy", "version": 3}],
            "session": 7,
            "silent_s": 0.1,
        }
    },
    "leased": 2,
    "ready": 1,
    "pending_generates": 1,
    "batches_in_repair": [4],
    "prefetch": 2,
    "paused": False,
    "starved": None,
    "trainer": "trainer-1",
    "prompts": COUNTS,
    "data_epochs": [0, 1],
    "last_rollout_id": 4,
    "trimmed_upto": 1,
    "consumed_upto": 3,
    "filtered_total": 6,
    "fenced_messages": {"receipt": 1},
    "weights": {
        "version": 3,
        "updates": 3,
        "kind": "distributed",
        "path": "",
        "lock": {"holder": "trainer-1", "kind": "catch_up", "update_id": 9, "step": "bucket", "deadline_in_s": 2.5},
        "engines": {"a1/sim-0": 3},
        "behind": ["a1/sim-1"],
    },
    "evaluations": {
        "math": {"running": False, "prompts": 4, "last": METRICS},
        "code": {"running": True, "pass": 1, "prompts": 10, "finished": 3, "leased": 2, "waiting": 1},
    },
    "sources": {"default": {"weight": 1.0, "prompts": COUNTS, "data_epochs": [0, 1], "filtered": 6}},
    "held": 1,
    "receipts": {"accepted": 12, "refused": 0},
    "gateways": [],
    "waiting_for_update": None,
}


def test_stats_decode_every_section_and_keep_the_whole_answer():
    stats = FleetStats.from_wire(json.loads(json.dumps(STATS)))
    assert isinstance(stats, CoordinatorStats), "the stats record imports under its other name too"
    assert (stats.paused, stats.trainer, stats.leased, stats.held) == (False, "trainer-1", 2, 1)
    assert stats.weights.version == 3 and stats.weights.behind == ("a1/sim-1",)
    assert stats.weights.lock == WeightLock("trainer-1", "catch_up", 9, "bucket", 2.5)
    assert stats.batches.last_rollout_id == 4 and stats.batches.in_repair == (4,) and stats.batches.ready == 1
    assert stats.prompts == PromptCounts(**COUNTS) and stats.data_epochs == (0, 1)
    engine = {"name": "sim-0", "state": "healthy", "version": 3}
    assert stats.agents["a1"] == AgentInfo("alive", 4, 2, (engine,), 7, 0.1)
    assert stats.sources["default"].prompts.delivered == 8 and stats.sources["default"].filtered == 6
    assert stats.evaluations["math"].last == EvalMetrics.from_wire(METRICS)
    assert stats.evaluations["code"].running and stats.evaluations["code"].pass_id == 1
    assert stats.receipts == {"accepted": 12, "refused": 0} and stats.fenced_messages == {"receipt": 1}
    assert stats.to_dict() == STATS and "raw" not in repr(stats)


def test_a_replays_fewer_keys_read_as_their_zeros():
    replay = {  # coordinator/replay_core.py's statistics
        "replay": {"from": "/runs/a", "rollout_ids": "0-3 (4 batches)", "served_upto": 3},
        "agents": {},
        "paused": True,
        "weights": {"version": 2, "updates": 1, "kind": "disk", "path": "/c", "lock": None, "engines": {},
                    "behind": [], "not_applied": [{"version": 2, "kind": "disk", "path": "/c"}]},
        "evaluations": {"small": {"recorded_passes": 2}},
    }  # fmt: skip
    stats = FleetStats.from_wire(replay)
    assert stats.paused and stats.weights.version == 2 and stats.weights.lock is None
    assert stats.batches.last_rollout_id == -1 and stats.prompts == PromptCounts() and stats.agents == {}
    assert stats.evaluations["small"].last is None
    assert stats.raw["weights"]["not_applied"][0]["version"] == 2


def test_evaluation_metrics_read_pass_at_k_and_keep_the_wire_keys():
    m = EvalMetrics.from_wire(METRICS)
    assert (m.pass_id, m.pass_at, m.weight_versions) == (2, {1: 0.5, 2: 0.75}, ("3", "default"))
    assert m.to_dict()["pass@2"] == 0.75


def test_weight_results_say_a_retry_and_travel_between_ranks():
    answer = {"update_id": 5, "version": 2, "engines": {"a1/sim-0": 2}}
    first = WeightUpdateResult.from_wire(answer)
    assert first.retried is None and "retried" not in first.to_dict()
    again = WeightUpdateResult.from_wire(answer, retried="WeightUpdateError: engine a2/sim-0 lost")
    assert again.retried.startswith("WeightUpdateError") and again.to_dict()["retried"] == again.retried
    assert pickle.loads(pickle.dumps(again)) == again
    assert repr(first) == "WeightUpdateResult(update_id=5, version=2, engines={'a1/sim-0': 2}, retried=None)"


def test_pause_resume_and_mixture_answers():
    assert PauseResult.from_wire({"leased": 0}).drained and not PauseResult.from_wire({"leased": 3}).drained
    assert ResumeResult.from_wire({}) == ResumeResult()
    mix = MixtureResult.from_wire({"from_rollout_id": 6, "weights": {"math": 0.2, "code": 0.8}})
    assert (mix.from_rollout_id, mix.weights) == (6, {"math": 0.2, "code": 0.8})


def test_item_access_answers_as_the_dict_did_with_a_deprecation_warning():
    stats = FleetStats.from_wire(STATS)
    with pytest.warns(DeprecationWarning, match=r"FleetStats\['weights'\]: the trainer API returns records"):
        assert stats["weights"]["version"] == 3
    with pytest.warns(DeprecationWarning):
        assert PauseResult.from_wire({"leased": 0})["leased"] == 0
