"""``Sample.weight_version`` on the generate-function path (agent/custom_rollout.py) is the LAST span's
version, as on the single-call path: a response that lived across an update was finished on the newer
weights, and staleness is reckoned from them."""

from __future__ import annotations

from array import array

from agent.custom_rollout import to_sample
from common.generation import Trajectory


def test_a_trajectory_across_an_update_reports_its_last_spans_version():
    traj = Trajectory()
    traj.tokens, traj.logprobs, traj.loss_mask = [1, 2, 3, 4], [0.0] * 4, [1] * 4
    traj.weight_versions = [["3", 0, 2], ["4", 2, 4]]
    sample = to_sample(traj, array("i", [9]), None, {})
    assert sample.weight_version == "4"
    assert sample.weight_versions == [["3", 0, 2], ["4", 2, 4]]


def test_a_trajectory_without_spans_reports_no_version():
    traj = Trajectory()
    assert to_sample(traj, array("i", [9]), None, {}).weight_version == ""
