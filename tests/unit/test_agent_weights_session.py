"""The agent core during weight updates (docs/weights.md), and span bookkeeping: pure, no sockets."""

from __future__ import annotations

import dataclasses

from agent.engine_client import _message, parse_version
from agent.engine_plan import plan_engines, sglang_command
from agent.events import (
    AbortRequests,
    AssignEngine,
    Connected,
    EngineVersion,
    GenerationEnded,
    RunWeightsStep,
    SetWeights,
    StartLease,
    WeightsRecord,
    WeightsStepDone,
)
from agent.leases import LeaseState
from agent.spans import continuation, join, merge_spans
from common import protocol as p
from common.config import RolloutConfig
from tests.unit.test_agent_session import N, commit, heartbeat, make_session, of, recv, sent, start, welcome

# ---------------------------------------------------------------------------- steps and reports


def joined(**kw):
    s = make_session()
    s.handle(Connected(), 0.0)
    recv(s, welcome(**kw))
    return s


def test_each_weights_message_becomes_one_step_and_each_step_done_one_report():
    s = joined()
    for msg in (
        p.WeightsBegin(1, 5),
        p.WeightsInitGroup(1, "127.0.0.1", 2900, 2, "g", "gloo", {"e0": 1}),
        p.WeightsBucket(1, 0, "g", ["w"], ["float32"], [[2]]),
        p.WeightsFinish(1, 5),
    ):
        assert of(recv(s, msg), RunWeightsStep) == [RunWeightsStep(msg)]
    assert s.weights.updating and s.weights.running == 4
    out = s.handle(WeightsStepDone(1, "bucket", True, seq=0, engines={"e0": 0}), 0.0)
    assert sent(out, p.WeightsReport) == [p.WeightsReport(s.session, 1, "bucket", True, 0, {"e0": 0}, "")]
    out = s.handle(WeightsStepDone(1, "init", False, error="engine e0 of agent a1: refused"), 0.0)
    [report] = sent(out, p.WeightsReport)
    assert not report.ok and "engine e0" in report.error


def test_no_lease_goes_on_an_engine_while_an_update_runs_and_waiting_leases_start_when_it_ends():
    s = joined()
    recv(s, p.WeightsFromDisk(1, 3, "/ckpt/3"))
    assert start(s, 10) == [], "a new lease waits for the update"
    assert s.leases[10].state is LeaseState.WAITING
    out = s.handle(WeightsStepDone(1, "disk", True, engines={"e0": 3}, record=WeightsRecord(3, "disk", "/ckpt/3")), 0.0)
    [assign] = of(out, AssignEngine)
    assert assign.lease == 10 and not assign.resume
    assert s.weights.current == WeightsRecord(3, "disk", "/ckpt/3") and not s.weights.updating


def test_a_generation_an_update_aborted_is_resumed_after_it_ends():
    s = joined()
    [a] = start(s, 10)
    recv(s, p.WeightsBegin(1, 4))
    assert of(s.handle(GenerationEnded(10, aborted=True), 0.0), AssignEngine) == []
    assert s.leases[10].state is LeaseState.WAITING and s.leases.pool.engines["e0"].in_flight == 0
    for msg in (p.WeightsBucket(1, 0, "g", [], [], []), p.WeightsFinish(1, 4)):
        recv(s, msg)
    s.handle(WeightsStepDone(1, "begin", True), 0.0)
    assert of(s.handle(WeightsStepDone(1, "bucket", True), 0.0), AssignEngine) == [], "finish still runs"
    [again] = of(
        s.handle(WeightsStepDone(1, "finish", True, record=WeightsRecord(4, "distributed")), 0.0), AssignEngine
    )
    assert again.resume and again.request_ids != a.request_ids
    commit(s, 10)
    assert 10 not in s.leases


def test_an_abort_that_comes_back_after_the_update_ended_is_still_the_updates():
    s = joined()
    start(s, 10)
    recv(s, p.WeightsFromDisk(1, 3, "/ckpt"))
    s.handle(WeightsStepDone(1, "disk", True, record=WeightsRecord(3, "disk", "/ckpt")), 0.0)
    [again] = of(s.handle(GenerationEnded(10, aborted=True), 0.0), AssignEngine)
    assert again.resume


def test_an_abort_without_an_update_starts_the_group_over():
    s = joined()
    start(s, 10)
    [again] = of(s.handle(GenerationEnded(10, aborted=True), 0.0), AssignEngine)
    assert not again.resume


def test_a_pause_with_abort_during_an_update_still_gives_the_lease_back():
    s = joined()
    start(s, 10)
    recv(s, p.WeightsBegin(1, 4))
    out = recv(s, p.Control(action="pause", abort=True))
    assert of(out, AbortRequests)
    out = s.handle(GenerationEnded(10, aborted=True), 0.0)
    assert [m.leases for m in sent(out, p.Release)] == [[10]] and 10 not in s.leases


def test_the_welcome_says_which_weights_the_fleet_is_on_and_ends_an_update_of_the_old_session():
    s = make_session()
    s.handle(Connected(), 0.0)
    msg = dataclasses.replace(welcome(), weights=p.FleetWeights(7, "disk", "/ckpt/7"))
    out = recv(s, msg)
    assert of(out, SetWeights) == [SetWeights(WeightsRecord(7, "disk", "/ckpt/7"))]
    recv(s, p.WeightsBegin(2, 8))
    s.handle(Connected(), 1.0)
    out = recv(s, msg, 1.0)
    [step] = of(out, RunWeightsStep)
    assert step.msg == p.WeightsAbort(2, 7, "/ckpt/7") and not step.report
    assert of(out, SetWeights) == [], "same weights as before"
    s.handle(WeightsStepDone(2, "begin", False, error="aborted while it ran"), 1.0)
    out = s.handle(WeightsStepDone(2, "abort", True, record=WeightsRecord(7, "disk", "/ckpt/7"), report=False), 1.0)
    assert sent(out, p.WeightsReport) == [] and not s.weights.updating


def test_engine_entries_carry_tp_and_version_in_register_and_heartbeat():
    s = make_session()
    s.handle(EngineVersion("e0", 3, tp=2), 0.0)
    [reg] = sent(s.handle(Connected(), 0.0), p.Register)
    assert (reg.engines[0].tp, reg.engines[0].version) == (2, 3)
    recv(s, welcome())
    assert heartbeat(s, 0.0).engines[0].version == 3


def test_grants_during_an_update_start_their_runners():
    s = joined(config=RolloutConfig(n_samples_per_prompt=N, rollout_batch_size=2))
    recv(s, p.WeightsBegin(1, 2))
    out = recv(
        s,
        p.Grant(
            s.session,
            [p.LeaseGrant(3, 0, 3, 0, prompt="x", label=1)],
        ),
    )
    assert [i.lease for i in of(out, StartLease)] == [3]


# ---------------------------------------------------------------------------- spans


def answer(ids, version, finish="stop", spans=None, text=None):
    meta = {
        "finish_reason": {"type": finish},
        "weight_version": version,
        "output_token_logprobs": [[-0.5, t, None] for t in ids],
    }
    if spans is not None:
        meta["weight_versions"] = spans
    return {
        "text": text if text is not None else "".join(chr(97 + t % 26) for t in ids),
        "output_ids": ids,
        "meta_info": meta,
    }


def test_one_answer_gives_one_span_from_its_label_when_the_engine_sends_none():
    tokens, logprobs, text, spans = join([answer([1, 2, 3], "2")])
    assert tokens == [1, 2, 3] and logprobs == [-0.5] * 3 and spans == [["2", 0, 3]]


def test_answers_concatenate_and_each_adds_its_span_offset_by_the_tokens_held():
    first = answer([1, 2], "default", "abort", spans=[{"version": "default", "start": 0, "end": 2}])
    second = answer([3, 4, 5], "1", spans=[{"version": "1", "start": 0, "end": 3}])
    tokens, logprobs, text, spans = join([first, second])
    assert tokens == [1, 2, 3, 4, 5] and len(logprobs) == 5 and text == "bcdef"
    assert spans == [["default", 0, 2], ["1", 2, 5]]


def test_spans_of_one_version_merge_and_empty_ones_go():
    assert merge_spans([["1", 0, 2], ["1", 2, 4], ["2", 4, 4], ["2", 4, 6]]) == [["1", 0, 4], ["2", 4, 6]]
    assert merge_spans([["0", 0, 0]]) == [["0", 0, 0]], "a zero-token answer keeps its version"


def test_a_continuation_sends_prompt_plus_output_with_the_budget_reduced():
    params = {"max_new_tokens": 10, "temperature": 1.0}
    assert continuation([7, 8], [], params) == ([7, 8], params)
    ids, budget = continuation([7, 8], [answer([1, 2, 3], "0", "abort")], params)
    assert ids == [7, 8, 1, 2, 3] and budget == {"max_new_tokens": 7, "temperature": 1.0}
    assert params["max_new_tokens"] == 10


# ---------------------------------------------------------------------------- labels and launch


def test_labels_read_as_integer_versions_and_default_is_zero():
    assert [parse_version(label) for label in ("default", None, "0", "12", "step-3")] == [0, 0, 0, 12, None]


def test_sglang_messages_are_taken_out_of_error_bodies():
    body = '{"success": false, "message": "Failed to update weights: no such file"}'
    assert _message(f"http://e:1/x: HTTP 400: {body}") == "Failed to update weights: no such file"
    assert _message('http://e:1/x: HTTP 400: {"error": {"message": "bad"}}') == "bad"
    text = "http://e:1/flush_cache: HTTP 400: Cache not flushed"
    assert _message(text) == text


def test_engines_can_be_launched_with_a_weight_version_label():
    [sim] = plan_engines("sim", weight_version=3)
    assert sim.argv[sim.argv.index("--weight-version") + 1] == "3"
    assert "--weight-version" not in plan_engines("sim")[0].argv, "no flag: SGLang's own default label"
    argv = sglang_command("/m", host="127.0.0.1", port=30000, tp_size=2, weight_version=0)
    assert argv[argv.index("--weight-version") + 1] == "0"
