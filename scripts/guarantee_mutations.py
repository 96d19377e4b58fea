"""The deliberate bugs ``scripts/check_guarantees.py`` plants, one per row: each breaks one
guarantee of docs/concepts/guarantees.md (or, under "metrics", a per-batch metric the trainer logs), and the
named test must fail with it in place.

A mutation replaces ``old`` (which must occur exactly once in ``path``) by ``new``. When the code
moves, a mutation stops applying and the check reports it STALE: update the snippet, keeping the
bug the same.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutation:
    guarantee: str
    name: str
    what: str
    path: str
    old: str
    new: str
    test: str


G = "tests/cluster/test_guarantees.py::"
M = "tests/cluster/test_batch_metrics.py::"
X = "tests/cluster/test_mixtures.py::"
D = "tests/integration/test_full_disk.py::"
S = "tests/cluster/test_storage_full.py::"

MUTATIONS = [
    Mutation(
        "1",
        "receipt-before-commit",
        "the receipt leaves before the group is committed",
        "agent/lease_runner.py",
        '        receipt = PendingReceipt(lease, epoch, index, f"{epoch}:{index}:{lease:x}", len(samples), stats)\n',
        '        receipt = PendingReceipt(lease, epoch, index, f"{epoch}:{index}:{lease:x}", len(samples), stats)\n'
        "        self._dispatch(LeaseCommitted(lease, receipt))\n",
        G + "test_agent_killed_between_commit_and_receipt_has_every_group_recovered_at_registration",
    ),
    Mutation(
        "1",
        "store-two-transactions",
        "group and outbox entry written in two transactions, outbox first",
        "agent/store.py",
        'await self._submit([("group", k, payload), ("outbox", k, msgpack.packb(receipt, use_bin_type=True))])',
        'await self._submit([("outbox", k, msgpack.packb(receipt, use_bin_type=True))])\n'
        '        await self._submit([("group", k, payload)])',
        "tests/integration/test_store.py::test_store_sigkilled_at_random_moments_keeps_every_commit_whole",
    ),
    Mutation(
        "1",
        "store-commit-not-awaited",
        "commit returns before the transaction is durable",
        "agent/store.py",
        'await self._submit([("group", k, payload), ("outbox", k, msgpack.packb(receipt, use_bin_type=True))])',
        'self._submit_nowait([("group", k, payload), ("outbox", k, msgpack.packb(receipt, use_bin_type=True))])',
        "tests/integration/test_store.py::test_store_sigkilled_at_random_moments_keeps_every_commit_whole",
    ),
    Mutation(
        "2",
        "register-acks-without-recording",
        "registration answers unacked receipts 'accepted' without recording",
        "coordinator/admission.py",
        "accepted, _ = self._accept(rec, lease_id, epoch, index, key, stats, ops)\n            self._count_receipt",
        "accepted = True\n            self._count_receipt",
        G + "test_agent_killed_between_commit_and_receipt_has_every_group_recovered_at_registration",
    ),
    Mutation(
        "2",
        "fetched-batch-regenerated",
        "batch repair regenerates prompts of a batch the trainer already fetched",
        "coordinator/batches.py",
        "if rollout_id > self.consumed_upto:",
        "if True:",
        G + "test_a_fetched_batch_asked_again_after_its_node_retired_gets_only_fresh_prompts",
    ),
    Mutation(
        "2",
        "duplicate-receipt-accepted",
        "a second group for an accepted prompt is accepted too",
        "coordinator/admission.py",
        '            return False, "duplicate: prompt already accepted from another group"',
        '            return True, ""',
        "tests/unit/test_core.py::test_receipt_is_acknowledged_after_persist_and_counted_once",
    ),
    Mutation(
        "3",
        "dead-agent-leases-kept",
        "leases held for an agent presumed dead are never reissued, even once it is retired",
        "coordinator/admission.py",
        "            self._leases.release_held(rec.agent_id)\n"
        "            self._batches.retire_agent(rec.agent_id, ops)\n",
        "            self._batches.retire_agent(rec.agent_id, ops)\n",
        "tests/unit/test_core.py::test_held_prompts_are_pending_again_when_their_agent_is_retired_or_returns_without_them",
    ),
    Mutation(
        "3",
        "grant-before-cursor",
        "a grant can leave before the cursor covering its prompts is durable (no Persist carries the cursors)",
        "coordinator/core.py",
        "                e.ops.append(stamp)\n",
        "                pass\n",
        "tests/unit/test_core.py::test_grants_leave_only_behind_the_cursor_that_covers_them",
    ),
    Mutation(
        "3",
        "lost-grant-never-released",
        "leases the agent never received are never given back",
        "coordinator/core.py",
        "p.Heartbeat(r.session, max_lease=r.max_granted, paused=paused)",
        "p.Heartbeat(r.session, max_lease=0, paused=paused)",
        G + "test_a_lost_grant_is_released_by_heartbeat_reconciliation_and_its_prompts_generated",
    ),
    Mutation(
        "3",
        "capacity-of-engines-behind",
        "an agent whose engines are all behind the fleet's weights is leased work (a prompt pending again waits there)",
        "coordinator/admission.py",
        "        if self._weights.none_current(engines):\n            return 0\n",
        "",
        "tests/unit/test_core.py::test_a_prompt_pending_again_is_not_parked_on_a_node_whose_engines_are_behind_the_fleets_weights",
    ),
    Mutation(
        "4",
        "generate-not-replayed",
        "generate(rollout_id) asked again assembles a new batch",
        "coordinator/trainer.py",
        "        batch = batches.recorded.get(msg.rollout_id)\n        repair: list = []",
        "        batch = None\n        repair: list = []",
        "tests/cluster/test_e2e.py::test_same_rollout_id_returns_same_groups",
    ),
    Mutation(
        "5",
        "dead-sessions-accepted",
        "messages of a dead or replaced agent session are accepted",
        "coordinator/membership.py",
        "return rec if rec is not None and rec.status == ALIVE else None",
        "return next((r for r in self.agents.values() if r.session == session), None)",
        G + "test_messages_of_a_session_presumed_dead_are_fenced_and_the_agent_registers_again",
    ),
    Mutation(
        "5",
        "old-trainer-not-fenced",
        "a replaced trainer's requests are still served",
        "coordinator/trainer.py",
        "        if session == self.session and session != 0:",
        "        if session != 0:",
        "tests/cluster/test_pause_and_trainers.py::test_second_trainer_fences_the_first_whose_generate_was_waiting",
    ),
    Mutation(
        "6",
        "prefetch-bound-ignored",
        "admission goes past demand + prefetch",
        "coordinator/sources.py",
        "        self._wanted = [max(0, w - self.in_flight[s] - ready[s]) for s, w in enumerate(wanted)]\n",
        "        self._wanted = [max(0, w - self.in_flight[s] - ready[s]) + 8 for s, w in enumerate(wanted)]\n",
        "tests/cluster/test_e2e.py::test_trainer_that_stops_pulling_holds_work_at_the_bound",
    ),
    Mutation(
        "6",
        "checkpoint-never-trims",
        "consumed batches and payloads are kept forever",
        "coordinator/batches.py",
        "        for rollout_id in sorted(r for r in self.recorded if r <= previous):\n",
        "        for rollout_id in sorted(r for r in self.recorded if r < 0):\n",
        "tests/cluster/test_faults_coordinator.py::test_killed_trainer_resumes_from_checkpoint_and_consumed_payloads_are_trimmed",
    ),
    Mutation(
        "7",
        "held-back-groups-dropped",
        "a ready group held back by backpressure is dropped from assembly",
        "coordinator/ready.py",
        "        prompt = queue.popleft()\n        return prompt, self.take(prompt)",
        "        prompt = queue.popleft()\n        if len(queue) >= 5:\n"
        "            self.take(prompt)\n            prompt = queue.popleft()\n"
        "        return prompt, self.take(prompt)",
        "tests/cluster/test_e2e.py::test_trainer_that_stops_pulling_holds_work_at_the_bound",
    ),
    Mutation(
        "8",
        "staleness-admission-off",
        "admission ignores the staleness bound",
        "coordinator/core.py",
        "        if allowed is not None:\n            budget = min(budget, allowed)\n",
        "        if False:\n            budget = min(budget, allowed)\n",
        "tests/cluster/test_weights.py::test_staleness_bound_holds_with_an_update_every_step",
    ),
    Mutation(
        "8",
        "assembly-waits-only-for-its-own-leases",
        "batch t waits only for leases with start <= t - ETA (it may take younger groups and strand older ones)",
        "coordinator/staleness.py",
        "            if r >= size:\n"
        "                return False  # the batch takes B groups with start <= s, and so for every later s\n"
        "            if i + 1 > (s + self.eta - t) * size:\n                return True\n",
        "            if s <= t - self.eta:\n                return True\n",
        "tests/unit/test_staleness_assembly.py",
    ),
    Mutation(
        "8",
        "generate-fn-first-span-version",
        "a sample from a generate function reports its first span's weight version, not its last",
        "agent/custom_rollout.py",
        '        weight_version=str(spans[-1][0]) if spans else "",\n',
        '        weight_version=str(spans[0][0]) if spans else "",\n',
        "tests/unit/test_custom_rollout_versions.py",
    ),
    Mutation(
        "8",
        "version-mismatch-unchecked",
        "an engine that does not report the new version passes",
        "agent/weight_engines.py",
        "        if label != str(version):\n",
        "        if False:\n",
        "tests/integration/test_agent_weights.py::test_an_engine_that_does_not_report_the_new_version_fails_the_step_naming_it",
    ),
    Mutation(
        "8",
        "verify-first-tensor-only",
        "a verified update reads back only the first tensor sent (a torn last bucket passes as verified)",
        "coordinator/client_weights.py",
        "    picks = sorted({0, len(items) // 2, len(items) - 1})\n",
        "    picks = [0]\n",
        "tests/integration/test_agent_sglang.py::test_a_verified_update_passes_and_a_corrupted_last_tensor_fails_naming_engine_and_tensor",
    ),
    Mutation(
        "11",
        "staleness-budget-not-by-shares",
        "a mixture's staleness budget goes to the dataset that lacks most, not by shares",
        "coordinator/core.py",
        "            budget = min(budget, training.limit(allowance, ready.count))\n",
        "",
        "tests/cluster/test_mixture_staleness.py",
    ),
    Mutation(
        "9",
        "full-disk-eio-not-recognised",
        "LMDB's EIO from a commit that ran out of space part-way is not a full disk (a raw lmdb.Error)",
        "common/lmdb_env.py",
        "        if free is not None and free < MIN_FREE:\n",
        "        if free is not None and free < 0:\n",
        D + "test_a_store_commit_meeting_a_full_disk_in_lmdb_is_storage_full_and_loses_nothing[one-page-left]",
    ),
    Mutation(
        "9",
        "full-disk-not-checked-before-commit",
        "a commit goes to LMDB however little space the disk has left",
        "common/lmdb_env.py",
        "    if free is not None and free < need + MIN_FREE:\n",
        "    if free is not None and free < 0:\n",
        D + "test_a_store_commit_the_disk_cannot_hold_is_refused_before_lmdb_sees_it",
    ),
    Mutation(
        "3",
        "full-store-charged-to-prompt",
        "a group whose commit found the disk full counts as a failure of its prompt (filtered after a few)",
        "agent/lease_runner.py",
        "            self._dispatch(LeaseFailed(self.lease, failure=None))\n",
        "            self._dispatch(LeaseFailed(self.lease, failure=p.Failure.of('generation_failed', 'x')))\n",
        S + "test_a_full_disk_under_the_agent_store_is_charged_to_no_prompt_and_loses_nothing[checked]",
    ),
    Mutation(
        "9",
        "hung-engine-waited-on",
        "a weight step waits on an engine that never answers its pause (a hung engine stops the fleet)",
        "agent/weight_calls.py",
        "            async with asyncio.timeout(CALL_DEADLINE):\n                return await call\n",
        "            async with asyncio.timeout(None):\n                return await call\n",
        "tests/cluster/test_hung_engine.py",
    ),
    Mutation(
        "9",
        "unknown-fields-accepted",
        "a message with unknown fields is decoded",
        "common/wire.py",
        "    unknown = body.keys() - cls._FIELDS.keys()\n",
        "    unknown = set()\n",
        "tests/unit/test_protocol.py",
    ),
    Mutation(
        "9",
        "starvation-never-detected",
        "a reward that raises on every group makes generate() wait forever",
        "coordinator/starvation.py",
        "        if self._streak < self.after:\n",
        "        if True:\n",
        "tests/cluster/test_failing_rewards.py::test_reward_that_raises_starves_generate_with_its_name_and_burns_no_prompt",
    ),
    Mutation(
        "10",
        "eval-result-counted-twice",
        "a second result for an evaluation prompt replaces the first",
        "coordinator/evaluation.py",
        "        if self.prompts.state[index] == DONE:\n            return False\n",
        "",
        "tests/unit/test_evaluation_core.py::test_a_pass_leases_every_prompt_once_outside_the_training_bound_and_answers_after_the_commit",
    ),
    Mutation(
        "10",
        "eval-results-not-restored",
        "a restarted coordinator forgets the results of the running pass",
        "coordinator/evaluation.py",
        "                self.passes[name] = EvalPass(spec, rec, mine)\n",
        "                self.passes[name] = EvalPass(spec, rec, {})\n",
        "tests/cluster/test_evaluation.py::test_evaluation_resumes_after_coordinator_sigkill_counting_each_prompt_once",
    ),
    Mutation(
        "metrics",
        "truncated-ratio-per-group",
        "rollout/truncated_ratio divided by the batch's groups instead of its samples",
        "common/metrics.py",
        '    m["rollout/truncated_ratio"] = total("truncated") / samples if samples else 0.0\n',
        '    m["rollout/truncated_ratio"] = total("truncated") / n if n else 0.0\n',
        M + "test_every_batch_metric_equals_what_its_samples_give",
    ),
    Mutation(
        "metrics",
        "prompt-tokens-once-per-group",
        "rollout/prompt_tokens counts a group's prompt once, not once per sample",
        "agent/lease_runner.py",
        '            "prompt_tokens": len(input_ids) * len(samples),\n',
        '            "prompt_tokens": len(input_ids),\n',
        M + "test_every_batch_metric_equals_what_its_samples_give",
    ),
    Mutation(
        "metrics",
        "staleness-one-short",
        "rollout/staleness_* count one weight update fewer than a group lags",
        "coordinator/staleness.py",
        "        ages = [max(0, t - s) for s in starts]\n",
        "        ages = [max(0, t - s - 1) for s in starts]\n",
        M + "test_every_batch_metric_equals_what_its_samples_give",
    ),
    Mutation(
        "11",
        "mix-by-total-not-shares",
        "a batch takes the first ready groups of any dataset, not each dataset's share",
        "coordinator/batches.py",
        "        counts = self.composition(g.rollout_id) if counts is None else counts\n",
        "        counts = self.composition(g.rollout_id) if counts is None else counts\n"
        "        counts = [sum(counts)] + [0] * (len(counts) - 1) if self.ready.count[0] >= sum(counts) else counts\n",
        X + "test_three_sources_hold_their_shares_settings_and_epochs_and_set_mixture_survives_a_sigkill",
    ),
    Mutation(
        "11",
        "source-epochs-shared",
        "a source's prompts are read from another source's frontier (exactly once per source broken)",
        "coordinator/mix_frontier.py",
        "        taken = self.parts[source].take(now, open_new)\n",
        "        taken = self.parts[0].take(now, open_new)\n",
        X + "test_three_sources_hold_their_shares_settings_and_epochs_and_set_mixture_survives_a_sigkill",
    ),
    Mutation(
        "11",
        "set-mixture-not-recorded",
        "client.set_mixture changes the weights in memory only: a restarted coordinator forgets it",
        "coordinator/trainer.py",
        "        return [Persist([SetMixture(tuple(schedule))], [answer])]\n",
        "        return [Persist([], [answer])]\n",
        X + "test_three_sources_hold_their_shares_settings_and_epochs_and_set_mixture_survives_a_sigkill",
    ),
    Mutation(
        "12",
        "consumed-by-first-rank",
        "a sharded trainer's batch counts as consumed once any rank took its share: a node lost before the "
        "others took theirs loses their prompts",
        "coordinator/trainer.py",
        "        if batches.take(rollout_id, msg.rank, ops):  # every rank holds its share now\n",
        "        if batches.take(rollout_id, msg.rank, ops) or True:\n",
        "tests/cluster/test_sharded_shares.py::test_three_ranks_pull_disjoint_balanced_shares_and_survive_a_lost_node",
    ),
    Mutation(
        "12",
        "shares-overlap",
        "a rank's share also holds the lower ranks' groups: groups delivered to two ranks",
        "coordinator/records.py",
        "        return [g for g, r in zip(self.groups, self.ranks, strict=True) if r == rank]\n",
        "        return [g for g, r in zip(self.groups, self.ranks, strict=True) if r <= rank]\n",
        "tests/cluster/test_sharded_shares.py::test_three_ranks_pull_disjoint_balanced_shares_and_survive_a_lost_node",
    ),
    Mutation(
        "8",
        "sharded-retry-not-in-lockstep",
        "a trainer rank above 0 does not start its gathers over when rank 0 retries a push (the ranks fall apart)",
        "coordinator/sharded_weights.py",
        '                    log.info("%s: rank 0 retries once: %s", what, msg[1])\n                    k = 0\n',
        '                    log.info("%s: rank 0 retries once: %s", what, msg[1])\n',
        "tests/cluster/test_sharded_weights.py::test_an_engine_killed_inside_a_push_costs_one_retry_on_both_ranks_then_a_catch_up",
    ),
    Mutation(
        "metrics",
        "prompt-lengths-of-responses",
        "to_tensors()['prompt_lengths'] holds each sample's response length",
        "coordinator/batch.py",
        '"prompt_lengths": torch.tensor([len(s.prompt_tokens) for s in samples], dtype=torch.long)',
        '"prompt_lengths": torch.tensor([len(s.response_tokens) for s in samples], dtype=torch.long)',
        "tests/unit/test_documented_fields.py::test_every_to_tensors_key_is_what_each_samples_own_lists_give",
    ),
    Mutation(
        "metrics",
        "kept-groups-count-every-verdict",
        "rollout/dynamic_filter/kept_groups counts the dropped groups too",
        "common/metrics.py",
        'out[f"{prefix}/kept_groups"] = self.kept',
        'out[f"{prefix}/kept_groups"] = total',
        "tests/unit/test_documented_fields.py::"
        "test_filter_metrics_count_the_verdicts_the_test_sent_since_the_previous_batch_and_the_counters_all_of_them",
    ),
    Mutation(
        "metrics",
        "fetch-seconds-include-the-wait",
        "rollout/fetch_seconds is measured from the call, the coordinator's wait included",
        "coordinator/client_async.py",
        'metrics["rollout/fetch_seconds"] = time.monotonic() - started - waited',
        'metrics["rollout/fetch_seconds"] = time.monotonic() - started',
        "tests/cluster/test_documented_answers.py::test_every_endpoint_reports_what_the_trainer_and_the_agents_saw",
    ),
]
