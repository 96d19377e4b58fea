"""SimEngine: one simulated engine, its settings, readiness and crash switch.

The engine owns a :class:`~agent.sim.scheduler.Scheduler` (the request path), an
:class:`~agent.sim.output.OutputModel` and its weights (:mod:`agent.sim.weights`: the tensors it
holds, of which ``sim.accuracy`` sets the output model's accuracy; :mod:`agent.sim.weight_groups`:
its weight-update groups). HTTP lives in :mod:`agent.sim.http`, the info endpoints' payloads in
:mod:`agent.sim.info`. ``/generate`` answers 503 while the engine is starting
(``--startup-delay``) or ``--unhealthy``: SGLang opens its port only once ready.

The SGLang release it imitates (``--sglang-version``) and the SGLang settings the HTTP layer
honours (keys, load format, chat template) are set by :func:`agent.sim.versions.configure`;
``architectures`` is ``[--architecture]``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from agent.sim.config import CRASH_EXIT_CODE, engine_config
from agent.sim.info import ThroughputMeter
from agent.sim.output import OutputModel
from agent.sim.params import parse_generate
from agent.sim.sample import Sample
from agent.sim.scheduler import Scheduler
from agent.sim.versions import configure
from agent.sim.weight_groups import WeightGroups
from agent.sim.weights import WeightStore

# The logger keeps the name it had when the engine was one module, so existing log filters still match.
log = logging.getLogger("rollfleet.sim_engine")


class SimEngine:
    """One simulated engine: built from parsed flags (``args``) and/or keyword overrides named after flags."""

    def __init__(self, args: argparse.Namespace | None = None, **overrides: Any):
        cfg = engine_config(args, overrides)
        self.config = cfg
        self.host: str = cfg["host"]
        self.port: int = cfg["port"]  # the bound port once serving (port 0 picks one)
        self.slots: int = max(1, int(cfg["slots"]))
        self.stream_interval: int = max(1, int(cfg["stream_interval"]))
        self.seed: int = int(cfg["seed"])
        self.context_length: int = int(cfg["context_length"])
        self.model_path: str = str(cfg["model_path"])
        self.startup_delay: float = float(cfg["startup_delay"])
        self.unhealthy: bool = bool(cfg["unhealthy"])
        self.health_timeout: float = float(cfg["health_timeout"])
        self.crash_after: int = int(cfg["crash_after_requests"] or 0)
        self.corrupt_broadcasts: bool = bool(cfg.get("corrupt_broadcasts", False))
        self.corrupt_tensors: frozenset[str] = frozenset(cfg.get("corrupt_tensors") or ())
        self.architectures: list[str] = [str(cfg["architecture"])]
        self.init_delay: float = float(cfg.get("init_delay", 0.0))
        self.max_queued: int | None = cfg["max_queued_requests"]  # SGLang's --max-queued-requests
        if cfg["tokenizer_path"]:  # reported in /model_info, as SGLang does; the sim still tokenizes bytes
            self.tokenizer_path = str(cfg["tokenizer_path"])
        self.crash_fn: Callable[[int], Any] = os._exit
        self.max_total_num_tokens = max(self.context_length, self.slots * 4096)  # nominal: no real KV pool
        self.max_req_input_len = self.context_length - 1

        self.output_model = OutputModel(
            seed=self.seed,
            len_dist=cfg["output_len_dist"],
            len_median=max(1, int(cfg["output_len_median"])),
            len_sigma=float(cfg["output_len_sigma"]),
            len_max=max(1, int(cfg["output_len_max"])),
            accuracy=float(cfg["accuracy"]),
        )
        self.scheduler = Scheduler(
            slots=self.slots,
            token_latency_s=max(0.0, float(cfg["token_latency_ms"])) / 1000.0,
            prefill_latency_s=max(0.0, float(cfg["prefill_latency_ms"])) / 1000.0,
            weight_version=str(cfg["weight_version"]),
            output_model=self.output_model,
        )
        configure(self, cfg)
        self.base_accuracy = float(cfg["accuracy"])
        self.weights = WeightStore()
        self.weight_groups = WeightGroups(timeout_s=float(cfg["weight_sync_timeout"]), tp_size=int(cfg["tp_size"]))
        self.throughput = ThroughputMeter()
        self.ok_generate_calls = 0
        self._ready_at = time.monotonic() + max(0.0, self.startup_delay)

    @property
    def weight_version(self) -> str:
        return self.scheduler.weight_version

    def apply_weights(self, named: dict[str, Any], *, replace: bool) -> None:
        """Store tensors (a checkpoint replaces all, a bucket adds) and let ``sim.accuracy`` set the accuracy."""
        self.weights.apply(named, replace=replace)
        accuracy = self.weights.accuracy
        self.output_model.accuracy = self.base_accuracy if accuracy is None else accuracy

    def is_ready(self) -> bool:
        return not self.unhealthy and time.monotonic() >= self._ready_at

    @property
    def status(self) -> str:
        if self.unhealthy:
            return "UnHealthy"
        return "Up" if self.is_ready() else "Starting"

    def new_samples(self, data: dict) -> tuple[list[Sample], bool]:
        """Validate a ``/generate`` body and register its samples' rids (see :func:`parse_generate`)."""
        samples, multi = parse_generate(
            data,
            live_rids=self.scheduler.live_rids,
            context_length=self.context_length,
            default_stream_interval=self.stream_interval,
        )
        self.scheduler.live_rids.update(s.rid for s in samples)
        return samples, multi

    def crash(self, why: str) -> None:
        log.error("rollfleet-sim crashing on purpose (%s): exit %d", why, CRASH_EXIT_CODE)
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            self.crash_fn(CRASH_EXIT_CODE)

    def shutdown(self) -> None:
        """Abort everything scheduled and open the pause gate, so every pending call returns; leave the groups."""
        self.scheduler.shutdown()
        self.weight_groups.close()
