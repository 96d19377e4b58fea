"""RolloutBatch.to_tensors: padded torch tensors for training code."""

import pytest

from common.types import Group, Sample
from coordinator.client import RolloutBatch

torch = pytest.importorskip("torch")


def test_rows_are_prompt_plus_response_right_padded_with_aligned_logprobs():
    a = Sample([1, 2, 3], [4, 5], [-0.5, -0.25], [1, 1], 1.0, "completed", "v1")
    b = Sample([1, 2, 3], [6, 7, 8, 9], [-1.0, -2.0, -3.0, -4.0], [1, 1, 1, 0], 0.0, "truncated", "v1")
    batch = RolloutBatch(0, [Group(index=11, samples=[a, b])])
    t = batch.to_tensors(pad_token_id=0)
    assert t["tokens"].tolist() == [[1, 2, 3, 4, 5, 0, 0], [1, 2, 3, 6, 7, 8, 9]]
    assert t["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0], [1] * 7]
    assert t["loss_mask"].tolist() == [[0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1, 0]]
    assert t["rollout_logprobs"][0, 3:5].tolist() == [-0.5, -0.25]
    assert t["rewards"].tolist() == [1.0, 0.0]
    assert t["response_lengths"].tolist() == [2, 4]
    assert t["group_index"].tolist() == [11, 11]


def test_decoded_samples_hold_machine_arrays_that_torch_views_without_a_copy():
    s = Sample([1, 2, 3], [4, 5], [-0.5, -0.25], [1, 0], 1.0, "completed", "v1")
    back = Group.from_wire(Group(index=3, samples=[s]).to_wire()).samples[0]
    assert back == s and back.response_logprobs.tolist() == [-0.5, -0.25]
    assert (back.prompt_tokens.typecode, back.response_logprobs.typecode, back.loss_mask.typecode) == ("i", "d", "b")
    view = torch.frombuffer(back.response_tokens, dtype=torch.int32)
    back.response_tokens[0] = 40  # the tensor shares the array's memory
    assert view.tolist() == [40, 5]


def test_a_field_assigned_a_list_after_construction_still_encodes_and_pads():
    s = Sample([1, 2], [3, 4], [-0.5, -0.25], [1, 1], 1.0, "completed", "v1")
    s.loss_mask = [1, 0]  # reward or filter code may do this
    back = Group.from_wire(Group(index=0, samples=[s]).to_wire()).samples[0]
    assert back.loss_mask.tolist() == [1, 0]
    assert RolloutBatch(0, [Group(index=0, samples=[s])]).to_tensors()["loss_mask"].tolist() == [[0, 0, 1, 0]]


def test_versions_follow_each_samples_spans_and_staleness_is_measured_from_the_current_version():
    two = Sample([1, 2], [3, 4, 5, 6], [-0.1] * 4, [1, 1, 1, 1], 1.0, "completed", "5", weight_versions=[
        ["default", 0, 1], ["5", 1, 4]])  # fmt: skip  # a partial rollout continued on version 5
    one = Sample([1, 2, 3], [7, 8], [-0.2] * 2, [1, 1], 0.0, "completed", "4")  # no spans: all its weight_version
    odd = Sample([1], [9, 9, 9], [-0.3] * 3, [1, 0, 1], 0.0, "completed", "v2", weight_versions=[["3", 0, 1],
        ["v2", 2, 3]])  # fmt: skip  # token 1 uncovered (a tool's), token 2 an unparseable label
    t = RolloutBatch(0, [Group(index=0, samples=[two, one, odd])]).to_tensors()
    assert t["versions"].tolist() == [
        [-1, -1, 0, 5, 5, 5],
        [-1, -1, -1, 4, 4, -1],
        [-1, 3, -1, -1, -1, -1],
    ]
    assert "staleness" not in t
    s = RolloutBatch(0, [Group(index=0, samples=[two, one, odd])]).to_tensors(current_version=6)["staleness"]
    assert s.tolist() == [[-1, -1, 6, 1, 1, 1], [-1, -1, -1, 2, 2, -1], [-1, 3, -1, -1, -1, -1]]
