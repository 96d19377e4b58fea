"""The README's documented fields that pure code computes, each compared with a value computed apart from it.

Issue 39 part 3: a trainer reads ``RolloutBatch.to_tensors()`` and ``micro_batches()`` keys, the ``rollout/*``
batch metrics, ``stats()`` entries, the answers of ``pause``/``resume``/``set_mixture`` and the coordinator's
event counters behind ``/metrics``; a field computed wrong (a prompt length taken from the response, a count not
reset between batches, a stall measured from the wrong moment) goes straight into a loss or a dashboard. Here:

- the tensors are recomputed from each sample's own lists in plain Python (no torch, no ``coordinator.batch``
  helper), the versions from the spans as the README defines them;
- the ``rollout/*`` metrics over hand-built group statistics are hand-worked numbers;
- a pure coordinator core is driven message by message, and what it reports (the filter metrics of each batch,
  per dataset too; ``admission_stall_s``; ``stats()``; the counters ``/metrics`` reads; the answers) is compared
  with what the test itself did: the verdicts it sent and why, the receipts, the seconds it let pass.

The cluster side (values only a real fleet has: fetched batches, Prometheus' exposition, the agents' own
counters) is ``tests/cluster/test_documented_answers.py``.
"""

from __future__ import annotations

import random

import pytest

from common import protocol as p
from common.config import Liveness, RolloutConfig
from common.metrics import DropStats, batch_metrics
from common.mixture import EPOCH_BITS, SourceSpec
from common.types import Group, Sample
from coordinator.core import CoordinatorCore, CoreSettings, Persist
from coordinator.packing import count_micro_batches
from coordinator.staleness import Staleness

torch = pytest.importorskip("torch")
from coordinator.batch import RolloutBatch  # noqa: E402

N = 4  # samples per prompt in the core scenarios

# ---------------------------------------------------------------------- tensors


def make_batch(rng: random.Random, groups: int = 4) -> RolloutBatch:
    """Groups of samples of every shape: empty responses, loss masks with holes, spans of several versions, the
    launch label, a label that is not a number, no spans at all. Logprobs and rewards are exact in float32."""
    labels = ["3", "default", "v2", "7"]
    out = []
    for g in range(groups):
        samples = []
        for k in range(rng.randint(1, 4)):
            lp, lr = rng.randint(1, 7), rng.choice([0, 1, 3, 6, 11])
            label = labels[(g + k) % len(labels)]
            spans = []
            if lr > 1 and rng.random() < 0.6:
                cut = rng.randint(1, lr - 1)
                spans = [[label, 0, cut], ["8", cut, lr + 2]]  # the last span reaches past the response: clipped
            samples.append(
                Sample(
                    [rng.randint(1, 900) for _ in range(lp)],
                    [rng.randint(1, 900) for _ in range(lr)],
                    [-rng.randint(1, 64) / 8 for _ in range(lr)],
                    [rng.randint(0, 1) for _ in range(lr)],
                    rng.choice([0.0, 0.25, 1.0]),
                    rng.choice(["completed", "truncated"]),
                    label,
                    weight_versions=spans,
                )
            )
        out.append(Group(index=200 + 7 * g, samples=samples))
    return RolloutBatch(5, out)


def label_version(label) -> int:
    """The README's reading of a weight-version label: a number is itself, the launch label is 0, else -1."""
    if label in (None, "", "default"):
        return 0
    return int(label) if str(label).isdigit() else -1


def token_versions(s) -> list[int]:
    """Per response token, the version of the span covering it (-1 where none does); no spans: the sample's."""
    n = len(s.response_tokens)
    out = [-1] * n
    for label, start, end in s.weight_versions or [[s.weight_version, 0, n]]:
        for i in range(max(0, start), min(n, end)):
            out[i] = label_version(label)
    return out


def rows_of(batch: RolloutBatch) -> list[tuple[Group, Sample]]:
    return [(g, s) for g in batch.groups for s in g.samples]


def test_every_to_tensors_key_is_what_each_samples_own_lists_give():
    batch = make_batch(random.Random(7))
    pad, current = 1000, 9
    t = batch.to_tensors(pad_token_id=pad, current_version=current)
    rows = rows_of(batch)
    width = max(len(s.prompt_tokens) + len(s.response_tokens) for _, s in rows)
    expected: dict[str, list] = {k: [] for k in ("tokens", "attention_mask", "loss_mask", "rollout_logprobs")}
    expected |= {k: [] for k in ("rewards", "prompt_lengths", "response_lengths", "group_index", "versions")}
    expected["staleness"] = []
    for g, s in rows:
        prompt, response = list(s.prompt_tokens), list(s.response_tokens)
        fill = width - len(prompt) - len(response)
        versions = [-1] * len(prompt) + token_versions(s) + [-1] * fill
        expected["tokens"].append(prompt + response + [pad] * fill)
        expected["attention_mask"].append([1] * (len(prompt) + len(response)) + [0] * fill)
        expected["loss_mask"].append([0] * len(prompt) + list(s.loss_mask) + [0] * fill)
        expected["rollout_logprobs"].append([0.0] * len(prompt) + list(s.response_logprobs) + [0.0] * fill)
        expected["rewards"].append(s.reward)
        expected["prompt_lengths"].append(len(prompt))
        expected["response_lengths"].append(len(response))
        expected["group_index"].append(g.index)
        expected["versions"].append(versions)
        expected["staleness"].append([current - v if v >= 0 else -1 for v in versions])
    assert set(t) == set(expected)
    for key, value in expected.items():
        assert t[key].tolist() == value, key
    dtypes = {"loss_mask": torch.float32, "rollout_logprobs": torch.float32, "rewards": torch.float32}
    for key in expected:
        assert t[key].dtype == dtypes.get(key, torch.long), key
    # The workload has what the comparison is about: several groups, empty responses, prompts of other lengths
    # than their responses, uncovered or unparseable tokens, stale and current ones.
    assert len({g.index for g, _ in rows}) > 2 and 0 in expected["response_lengths"]
    assert expected["prompt_lengths"] != expected["response_lengths"]
    flat = [v for row in expected["versions"] for v in row]
    assert {0, 3, 8} <= set(flat) and any(-1 in token_versions(s) for _, s in rows)
    assert "staleness" not in batch.to_tensors()


@pytest.mark.parametrize("max_tokens", [6, 13, 40, 10_000])
def test_every_micro_batch_key_is_what_each_samples_own_lists_give(max_tokens):
    batch = make_batch(random.Random(max_tokens), groups=5)
    rows = rows_of(batch)
    current = 9
    mbs = batch.micro_batches(max_tokens, current_version=current)
    lengths = [len(s.prompt_tokens) + len(s.response_tokens) for _, s in rows]
    assert len(mbs) == count_micro_batches(lengths, max_tokens)
    placed = []
    keys = {"tokens", "position_ids", "cu_seqlens", "loss_mask", "rollout_logprobs", "versions", "staleness"}
    keys |= {"rewards", "prompt_lengths", "response_lengths", "group_index", "sample_index"}
    for mb in mbs:
        assert set(mb) == keys, "no attention_mask; every documented key"
        order = mb["sample_index"].tolist()
        assert order == sorted(order), "samples keep their batch order"
        placed += order
        packed = {k: [] for k in ("tokens", "position_ids", "loss_mask", "rollout_logprobs", "versions")}
        per_sample = {k: [] for k in ("rewards", "prompt_lengths", "response_lengths", "group_index")}
        bounds = [0]
        for i in order:
            g, s = rows[i]
            prompt, response = list(s.prompt_tokens), list(s.response_tokens)
            packed["tokens"] += prompt + response
            packed["position_ids"] += list(range(len(prompt) + len(response)))
            packed["loss_mask"] += [0] * len(prompt) + list(s.loss_mask)
            packed["rollout_logprobs"] += [0.0] * len(prompt) + list(s.response_logprobs)
            packed["versions"] += [-1] * len(prompt) + token_versions(s)
            per_sample["rewards"].append(s.reward)
            per_sample["prompt_lengths"].append(len(prompt))
            per_sample["response_lengths"].append(len(response))
            per_sample["group_index"].append(g.index)
            bounds.append(bounds[-1] + len(prompt) + len(response))
        for key, value in packed.items():
            assert mb[key].tolist() == [value], key
        assert mb["staleness"].tolist() == [[current - v if v >= 0 else -1 for v in packed["versions"]]]
        for key, value in per_sample.items():
            assert mb[key].tolist() == value, key
        assert mb["cu_seqlens"].tolist() == bounds and mb["cu_seqlens"].dtype == torch.int32
        assert bounds[-1] <= max_tokens or len(order) == 1, "over the budget only alone"
    assert sorted(placed) == list(range(len(rows))), "every sample in exactly one micro-batch"


# ---------------------------------------------------------------------- rollout/* over hand-built statistics


def test_batch_metrics_of_hand_built_group_statistics_are_the_hand_worked_numbers():
    stats = [
        {"n_samples": 4, "prompt_tokens": 40, "response_tokens": 100, "reward_sum": 3.0, "truncated": 1,
         "aborted": 0, "gen_seconds": 2.0},
        {"n_samples": 4, "prompt_tokens": 48, "response_tokens": 20, "reward_sum": 1.0, "truncated": 0,
         "aborted": 2, "gen_seconds": 5.0},
        {"n_samples": 2, "prompt_tokens": 10, "response_tokens": 30, "reward_sum": 0.5, "truncated": 2,
         "aborted": 0, "gen_seconds": 0.5},
    ]  # fmt: skip
    drops = DropStats(kept=5, dropped={"zero_std_0": 2, "zero std 1": 1})  # reasons become metric-safe names
    m = batch_metrics(
        stats, [0, 2, 1], drops, sources=["math", "code", "math"], source_drops={"math": 0, "code": 3, "tool": 1}
    )
    expected = {
        "rollout/groups": 3,
        "rollout/samples": 10,
        "rollout/prompt_tokens": 98,
        "rollout/response_tokens": 150,
        "rollout/response_len_mean": 15.0,  # 150 tokens / 10 samples
        "rollout/reward_mean": 0.45,  # 4.5 / 10
        "rollout/truncated_ratio": 0.3,  # 3 / 10 samples (not / 3 groups)
        "rollout/aborted_ratio": 0.2,
        "rollout/gen_seconds_mean": 2.5,  # 7.5 s / 3 groups
        "rollout/gen_seconds_max": 5.0,
        "rollout/data_epoch": 2,  # the highest
        "rollout/dynamic_filter/drop_zero_std_0": 2,
        "rollout/dynamic_filter/drop_zero_std_1": 1,
        "rollout/dynamic_filter/dropped_groups": 3,
        "rollout/dynamic_filter/kept_groups": 5,
        "rollout/dynamic_filter/dropped_ratio": 3 / 8,
        "rollout/source/math/groups": 2,
        "rollout/source/math/reward_mean": 3.5 / 6,
        "rollout/source/math/response_len_mean": 130 / 6,
        "rollout/source/math/truncated_ratio": 3 / 6,
        "rollout/source/math/dropped_groups": 0,
        "rollout/source/code/groups": 1,
        "rollout/source/code/reward_mean": 0.25,
        "rollout/source/code/response_len_mean": 5.0,
        "rollout/source/code/truncated_ratio": 0.0,
        "rollout/source/code/dropped_groups": 3,
        "rollout/source/tool/groups": 0,  # no group in this batch, yet drops behind it
        "rollout/source/tool/reward_mean": 0.0,
        "rollout/source/tool/response_len_mean": 0.0,
        "rollout/source/tool/truncated_ratio": 0.0,
        "rollout/source/tool/dropped_groups": 1,
    }
    assert set(m) == set(expected)
    for key, value in expected.items():
        assert m[key] == pytest.approx(value, abs=1e-12), key


def test_staleness_metrics_are_the_ages_of_the_batchs_groups_and_the_stall_since_the_previous_batch():
    s = Staleness(eta=3, batch_size=4)
    # Batch 5 of groups leased after 2, 5, 4 and 3 updates: ages 3, 0, 1, 2.
    s.note_admission(wanted=4, allowed=1, now=10.0)  # held back from 10 s ...
    s.note_admission(wanted=4, allowed=4, now=12.5)  # ... to 12.5 s
    s.note_admission(wanted=2, allowed=0, now=20.0)  # and again from 20 s, still held when the batch comes at 21
    m = s.metrics(5, [2, 5, 4, 3], now=21.0)
    assert m == {"rollout/staleness_mean": 1.5, "rollout/staleness_max": 3.0, "rollout/admission_stall_s": 3.5}
    # The next batch counts only its own stall: the open one from 21 s on, to 24.
    m = s.metrics(6, [6, 6], now=24.0)
    assert m == {"rollout/staleness_mean": 0.0, "rollout/staleness_max": 0.0, "rollout/admission_stall_s": 3.0}


# ---------------------------------------------------------------------- a pure core, driven by the test


def make_core(batch=2, prefetch=0, size=40, eta=None, mixture=None) -> CoordinatorCore:
    specs = [SourceSpec(name, w).to_dict() for name, w in (mixture or {}).items()]
    cfg = RolloutConfig(
        rollout_batch_size=batch, n_samples_per_prompt=N, prefetch=prefetch, max_staleness=eta, mixture=specs
    )
    return CoordinatorCore(CoreSettings(cfg, Liveness(0.25, 3.0, 10.0), (size,) * max(1, len(specs)), "fp"))


def sends(effects, kind=None, to=None) -> list:
    out = []
    for e in effects:
        items = e.then if isinstance(e, Persist) else [e]
        out += [s for s in items if (kind is None or isinstance(s.msg, kind)) and (to is None or s.to == to)]
    return out


class Driver:
    """Agents and a trainer around a pure core: every grant the core sends is kept as in flight, every answer to
    the trainer and every batch it records are collected, and the test decides what each lease's group does."""

    def __init__(self, core: CoordinatorCore, agents: dict[str, int], now: float = 0.0):
        self.core, self.now, self.req = core, now, 100
        self.in_flight: dict[int, tuple[str, p.LeaseGrant]] = {}
        self.kept: list[tuple[str, p.LeaseGrant]] = []
        self.granted: dict[str, int] = dict.fromkeys(agents, 0)
        self.batches: dict[int, p.BatchRefs] = {}
        self.answers: list = []
        self.engines = {a: [p.EngineInfo("e0", p.EngineState.HEALTHY, version=0)] for a in agents}
        for agent, groups in agents.items():
            msg = p.Register(agent, 1, groups * N, f"tcp://{agent}:1", self.engines[agent], [], [])
            self.note(core.handle(agent.encode(), msg, now))
        (ok,) = [s.msg for s in sends(core.handle(b"trainer", p.Attach(1, "trainer-x"), now), p.Ok)]
        self.session = ok.result["session"]

    def note(self, effects) -> list:
        for s in sends(effects, p.Grant):
            for lease in s.msg.leases:
                self.in_flight[lease.lease] = (s.to, lease)
                self.granted[s.to] += 1
        for s in sends(effects, to=b"trainer"):
            if isinstance(s.msg, p.BatchRefs):
                self.batches[s.msg.rollout_id] = s.msg
            else:
                self.answers.append(s.msg)
        return effects

    def trainer(self, make) -> list:
        self.req += 1
        return self.note(self.core.handle(b"trainer", make(self.session, self.req), self.now))

    def oldest(self, source: int | None = None) -> int:
        return min(
            lid for lid, (_, g) in self.in_flight.items() if source is None or g.data_epoch >> EPOCH_BITS == source
        )

    def keep(self, lease_id: int | None = None, reward_sum: float = 1.0) -> list:
        agent, g = self.in_flight.pop(self.oldest() if lease_id is None else lease_id)
        self.kept.append((agent, g))
        session = self.core.membership.agents[agent].session
        stats = {"n_samples": N, "reward_sum": reward_sum}
        receipt = p.Receipt(session, g.lease, g.data_epoch, g.index, f"{g.data_epoch}:{g.index}:{g.lease:x}", N, stats)
        return self.note(self.core.handle(agent.encode(), receipt, self.now))

    def drop(self, reason: str, lease_id: int | None = None) -> list:
        agent, g = self.in_flight.pop(self.oldest() if lease_id is None else lease_id)
        session = self.core.membership.agents[agent].session
        msg = p.Filtered(session, g.lease, g.data_epoch, g.index, reason)
        return self.note(self.core.handle(agent.encode(), msg, self.now))


def filter_metrics(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k.startswith("rollout/dynamic_filter/")}


def test_filter_metrics_count_the_verdicts_the_test_sent_since_the_previous_batch_and_the_counters_all_of_them():
    core = make_core(batch=2, prefetch=0, size=40)
    d = Driver(core, {"a": 4})
    d.trainer(lambda s, r: p.Generate(s, r, 0))
    assert len(d.in_flight) == 2
    # Batch 0: three groups dropped (a replacement leased for each), then two kept.
    for verdict in ("zero_std_0", "zero std 1", "zero_std_0", None, None):
        d.keep() if verdict is None else d.drop(verdict)
    assert filter_metrics(d.batches[0].metrics) == {
        "rollout/dynamic_filter/drop_zero_std_0": 2,
        "rollout/dynamic_filter/drop_zero_std_1": 1,
        "rollout/dynamic_filter/dropped_groups": 3,
        "rollout/dynamic_filter/kept_groups": 2,
        "rollout/dynamic_filter/dropped_ratio": 3 / 5,
    }
    # Batch 1 counts only what came after batch 0: kept, dropped (and replaced), kept.
    d.trainer(lambda s, r: p.Generate(s, r, 1, 1))  # prefetch 1 from now on: one group ahead
    d.trainer(lambda s, r: p.Consumed(s, r, 0))
    for verdict in (None, "too_long", None):
        d.keep() if verdict is None else d.drop(verdict)
    assert filter_metrics(d.batches[1].metrics) == {
        "rollout/dynamic_filter/drop_too_long": 1,
        "rollout/dynamic_filter/dropped_groups": 1,
        "rollout/dynamic_filter/kept_groups": 2,
        "rollout/dynamic_filter/dropped_ratio": 1 / 3,
    }
    assert d.batches[1].metrics["rollout/groups"] == 2 and d.batches[1].metrics["rollout/reward_mean"] == 1 / N
    # The prefetch: one more lease, which the test keeps: ready, not in a batch.
    assert len(d.in_flight) == 1
    d.keep()

    # What /metrics reads (coordinator/observe.py): every event the test made, since the start.
    c = core.counters
    assert c.drops == {"zero_std_0": 2, "zero_std_1": 1, "too_long": 1}
    assert c.lease_ends == {"filtered": 4, "receipt": 5}
    assert (c.leases_granted, c.receipts_accepted, c.receipts_refused, c.batches) == (9, 5, 0, 2)
    assert c.batches == len(c.recent) == sum(c.latency_counts)
    st = core.statistics()
    assert st.filtered_total == 4 and st.receipts == {"accepted": 5, "refused": 0}
    assert st.prompts == {"pending": 40 - 9, "leased": 0, "ready": 1, "delivered": 4, "filtered": 4}
    assert (st.leased, st.ready, st.last_rollout_id, st.consumed_upto, st.data_epochs) == (0, 1, 1, 0, (0,))
    assert st.prefetch == 1 and st.pending_generates == 0
    # A second group for a delivered prompt (another key) is refused, and counted so.
    agent, g = d.kept[0]
    assert [g.data_epoch, g.index] in [ref[:2] for ref in d.batches[0].groups]
    session = core.membership.agents[agent].session
    dup = p.Receipt(session, g.lease, g.data_epoch, g.index, "0:dup", N, {"n_samples": N})
    (ack,) = [s.msg for s in sends(core.handle(agent.encode(), dup, 0.0), p.ReceiptAck)]
    assert not ack.accepted
    assert core.statistics().receipts == {"accepted": 5, "refused": 1} and c.receipts_refused == 1


def test_per_dataset_drops_are_those_of_each_datasets_own_prompts():
    core = make_core(batch=2, prefetch=0, size=20, mixture={"a": 1.0, "b": 1.0})  # one group of each a batch
    d = Driver(core, {"n": 4})
    d.trainer(lambda s, r: p.Generate(s, r, 0))
    sources = sorted(g.data_epoch >> EPOCH_BITS for _, g in d.in_flight.values())
    assert sources == [0, 1]
    d.drop("zero_std_0", d.oldest(1))  # b's replacement comes from b
    d.drop("zero_std_1", d.oldest(1))
    d.drop("zero_std_0", d.oldest(0))
    d.keep(d.oldest(1))
    d.keep(d.oldest(0))
    m = d.batches[0].metrics
    for name, dropped in (("a", 1), ("b", 2)):
        assert m[f"rollout/source/{name}/groups"] == 1, name
        assert m[f"rollout/source/{name}/dropped_groups"] == dropped, name
    assert m["rollout/dynamic_filter/dropped_groups"] == 3
    sources = core.statistics().sources
    assert {name: sources[name]["filtered"] for name in ("a", "b")} == {"a": 1, "b": 2}
    assert {name: sources[name]["prompts"]["filtered"] for name in ("a", "b")} == {"a": 1, "b": 2}
    assert {name: sources[name]["prompts"]["delivered"] for name in ("a", "b")} == {"a": 1, "b": 1}
    # set_mixture answers with the first rollout id not recorded and the weights over every dataset.
    d.trainer(lambda s, r: p.SetMixture(s, r, {"b": 3}))
    assert d.answers[-1].result == {"from_rollout_id": 1, "weights": {"a": 0.0, "b": 3.0}}
    assert {name: core.statistics().sources[name]["weight"] for name in ("a", "b")} == {"a": 0.0, "b": 3.0}


def test_admission_stall_is_the_time_the_staleness_bound_held_back_a_waiting_batch():
    core = make_core(batch=2, prefetch=0, eta=0)
    d = Driver(core, {"a": 4})
    d.trainer(lambda s, r: p.Generate(s, r, 0))
    d.keep(), d.keep()
    assert d.batches[0].metrics["rollout/admission_stall_s"] == 0.0
    # Batch 1 at ETA 0 waits for update 1: asked at 1.0 s, pushed at 3.0, recorded by the agent at 3.5 s.
    d.now = 1.0
    d.trainer(lambda s, r: p.Consumed(s, r, 0))
    d.trainer(lambda s, r: p.Generate(s, r, 1))
    assert not d.in_flight, "nothing leased for rollout 1 before update 1"
    d.now = 3.0
    eff = d.trainer(lambda s, r: p.UpdateWeights(s, r, 1, "disk", "/ckpt", timeout=300.0))
    (step,) = sends(eff, p.WeightsFromDisk)
    d.now = 3.5
    session = core.membership.agents["a"].session
    d.note(core.handle(b"a", p.WeightsReport(session, step.msg.update_id, "disk", True, 0, {"e0": 1}, ""), d.now))
    assert d.answers[-1].result["version"] == 1 and len(d.in_flight) == 2
    d.now = 4.0
    d.keep(), d.keep()
    m = d.batches[1].metrics
    assert m["rollout/admission_stall_s"] == pytest.approx(2.5)
    assert (m["rollout/staleness_mean"], m["rollout/staleness_max"]) == (0.0, 0.0)


def test_statistics_and_answers_are_what_the_test_did():
    core = make_core(batch=2, prefetch=0, size=40)
    d = Driver(core, {"a": 3, "b": 2})
    st = core.statistics()
    assert {a: (r.status, r.capacity, r.leases, list(r.engines)) for a, r in st.agents.items()} == {
        "a": ("alive", 3, 0, [e.to_dict() for e in d.engines["a"]]),
        "b": ("alive", 2, 0, [e.to_dict() for e in d.engines["b"]]),
    }
    assert st.trainer == "trainer-x" and st.paused is False and st.prefetch == 0 and st.held == 0
    d.trainer(lambda s, r: p.Generate(s, r, 0, 3))  # prefetch 3: 2 + 3 leases, all the fleet's capacity
    st = core.statistics()
    assert st.prefetch == 3 and st.pending_generates == 1 and st.leased == len(d.in_flight) == 5
    assert {a: r.leases for a, r in st.agents.items()} == d.granted == {"a": 3, "b": 2}
    assert st.prompts["leased"] == 5 and st.prompts["pending"] == 35
    d.keep(), d.keep()
    st = core.statistics()
    assert (st.pending_generates, st.last_rollout_id, st.leased, st.ready) == (0, 0, 3, 0)
    d.trainer(lambda s, r: p.Consumed(s, r, 0))
    # pause without drain answers with the leases in flight then; with drain, once none is.
    d.trainer(lambda s, r: p.Pause(s, r, False))
    assert d.answers[-1].result == {"leased": 3} and core.statistics().paused is True
    d.trainer(lambda s, r: p.Pause(s, r, True))
    n_answers = len(d.answers)
    d.keep(), d.keep()
    assert len(d.answers) == n_answers, "the drain waits for the last lease"
    d.keep()
    assert d.answers[-1].result == {"leased": 0}
    st = core.statistics()
    assert (st.consumed_upto, st.trimmed_upto, st.ready, st.leased) == (0, -1, 3, 0)
    d.trainer(lambda s, r: p.StateDict(s, r, 0))
    state = d.answers[-1].result
    assert state["rollout_id"] == 0 and state["dataset_size"] == 40 and state["dataset_fingerprint"] == "fp"
    assert state["format"] == 1 and state["mixture"] == [[0, [1.0]]]
    assert (state["config"]["rollout_batch_size"], state["config"]["n_samples_per_prompt"]) == (2, N)
    assert core.statistics().trimmed_upto == -1, "a first checkpoint trims nothing"
    d.trainer(lambda s, r: p.Resume(s, r))
    assert d.answers[-1].result == {} and core.statistics().paused is False
    d.trainer(lambda s, r: p.Generate(s, r, 1, 0))
    d.trainer(lambda s, r: p.Consumed(s, r, 1))
    d.trainer(lambda s, r: p.Pause(s, r, True))
    d.trainer(lambda s, r: p.StateDict(s, r, 1))
    st = core.statistics()
    assert (st.last_rollout_id, st.consumed_upto, st.trimmed_upto, st.ready) == (1, 1, 0, 1)
    # b falls silent past the TTL while a heartbeats: b's leases (none now) and a's session; a late message from
    # b's old session is refused and counted by its type.
    d.trainer(lambda s, r: p.Resume(s, r))
    d.trainer(lambda s, r: p.Generate(s, r, 2, 4))
    b_leases = [lid for lid, (agent, _) in d.in_flight.items() if agent == "b"]
    assert b_leases
    old_b = core.membership.agents["b"].session
    a_session = core.membership.agents["a"].session
    for t in [0.25 * i for i in range(1, 17)]:
        d.note(core.handle(b"a", p.Heartbeat(a_session), t))
        d.note(core.tick(t))
    st = core.statistics(4.0)
    assert st.agents["b"].status == "dead" and st.held == len(b_leases)
    assert st.agents["b"].silent_s == pytest.approx(4.0) and st.agents["a"].silent_s == 0.0
    core.handle(b"b", p.Heartbeat(old_b), 4.0)
    agent, g = d.in_flight[b_leases[0]]
    core.handle(b"b", p.Receipt(old_b, g.lease, g.data_epoch, g.index, "late", N, {}), 4.0)
    assert core.statistics().fenced_messages == {"heartbeat": 1, "receipt": 1}


def test_a_running_evaluation_pass_shows_the_results_and_leases_the_test_made_then_its_metrics():
    from coordinator.evaluation import EvalSpec

    spec = EvalSpec("math", size=6, fingerprint="efp", n_samples=2)
    cfg = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=N, prefetch=2)
    core = CoordinatorCore(CoreSettings(cfg, Liveness(0.25, 3.0, 10.0), (20,), "fp", eval_specs=(spec,)))
    eff = core.handle(b"a", p.Register("a", 1, 5 * N, "tcp://a:1", [], [], []), 0.0)  # 5 groups at once
    session = sends(eff, p.Welcome)[0].msg.session
    (ok,) = [s.msg for s in sends(core.handle(b"t", p.Attach(1, "t"), 0.0), p.Ok)]
    assert core.statistics().evaluations == {"math": {"running": False, "prompts": 6, "last": {}}}
    in_flight = {}

    def note(effects):
        for s in sends(effects, p.Grant):
            in_flight.update({g.lease: g for g in s.msg.leases if g.eval})
        return [s.msg for s in sends(effects, p.Ok)]

    note(core.handle(b"t", p.Evaluate(ok.result["session"], 7, "math", "tok"), 0.5))
    assert len(in_flight) == 3, "the capacity the prefetch's 2 training leases leave"
    finished, answers = 0, []
    while in_flight:
        running = core.statistics().evaluations["math"]
        assert running == {"running": True, "pass": 1, "prompts": 6, "finished": finished, "leased": len(in_flight),
                           "waiting": 1}  # fmt: skip
        g = in_flight.pop(min(in_flight))
        res = p.EvalOutcome(rewards=[1.0, 0.0], lengths=[3, 5], truncated=1, versions=["0"])
        answers += note(core.handle(b"a", p.EvalResult(session, g.lease, g.eval, g.eval_pass, g.index, res), 1.0))
        finished += 1
    assert finished == 6 and len(answers) == 1
    last = core.statistics().evaluations["math"]
    assert last == {"running": False, "prompts": 6, "last": answers[0].result}
    assert (answers[0].result["samples"], answers[0].result["reward_mean"]) == (12, 0.5)
