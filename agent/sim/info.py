"""Payloads of the info endpoints: ``/model_info``, ``/server_info`` and ``/v1/loads``.

Field names and shapes are SGLang's; the values describe one DP rank with a nominal KV pool
(``max_total_num_tokens``). ``/v1/loads`` ignores its ``include``/``format`` parameters and
answers JSON with the core fields. ``/server_info`` adds a ``sim`` section with the sim's own
output-model settings and weights. Both ``/model_info`` and ``/server_info`` report
``weight_digest``, the :func:`common.weights_digest.weights_digest` of the tensors the engine
holds (not an SGLang field). With ``--sglang-version 0.5.23`` ``/model_info`` also has 0.5.23's
``served_model_name``, ``load_format``, ``reasoning_parser``, ``tool_call_parser`` and
``disaggregation_mode``. ``/server_info`` reports ``device`` and ``quantization`` (ServerArgs
fields), and two fields of its own: ``rollfleet_sglang_version`` (the release imitated) and
``rollfleet_weight_update_session`` (whether a weight-update session is open).

Another engine with the same surface (the hf engine) may name itself: ``engine.version``,
``engine.tokenizer_path``, ``engine.model_type``, ``engine.architectures``, and
``engine.info_section()`` in place of the ``sim`` section; absent, the sim's values apply.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from agent.sim.config import VERSION
from common.tokenizer import BYTE_TOKENIZER_NAME

if TYPE_CHECKING:
    from agent.sim.engine import SimEngine


class ThroughputMeter:
    """Generated tokens per second, re-measured at most once a second (when loads are asked for)."""

    def __init__(self) -> None:
        self._mark = (time.monotonic(), 0)
        self.tokens_per_s = 0.0

    def update(self, generated_tokens: int) -> float:
        now = time.monotonic()
        t, tokens = self._mark
        if now - t >= 1.0:
            self.tokens_per_s = (generated_tokens - tokens) / (now - t)
            self._mark = (now, generated_tokens)
        return self.tokens_per_s


def loads(engine: SimEngine) -> dict:
    """The load of the engine's one DP rank (an entry of ``/v1/loads``' ``loads``)."""
    scheduler = engine.scheduler
    throughput = engine.throughput.update(scheduler.generated_tokens)
    used = 0
    for sample in scheduler.running():
        used += len(sample.prompt.ids) + sample.position
    waiting_tokens = sum(len(s.prompt.ids) for s in scheduler.waiting())
    return {
        "dp_rank": 0,
        "num_running_reqs": scheduler.num_running,
        "num_waiting_reqs": scheduler.num_waiting,
        "num_waiting_uncached_tokens": waiting_tokens,
        "num_used_tokens": used,
        "num_total_tokens": used + waiting_tokens,
        "max_total_num_tokens": engine.max_total_num_tokens,
        "max_running_requests": engine.slots,
        "token_usage": used / engine.max_total_num_tokens,
        "gen_throughput": throughput,
        "cache_hit_rate": (scheduler.cached_tokens / scheduler.prompt_tokens) if scheduler.prompt_tokens else 0.0,
        "utilization": scheduler.num_running / engine.slots,
    }


def loads_response(engine: SimEngine) -> dict:
    version = getattr(engine, "version", VERSION)
    return {"timestamp": datetime.now(UTC).isoformat(), "version": version, "loads": [loads(engine)]}


def model_info(engine: SimEngine, *, digest: bool = True) -> dict:
    """``/model_info``; ``digest=False`` (``?digest=0``) leaves ``weight_digest`` out, which costs a hash of
    every tensor held after each update: the agent, which reads only the label, asks that way."""
    out = {
        "model_path": engine.model_path,
        "tokenizer_path": getattr(engine, "tokenizer_path", BYTE_TOKENIZER_NAME),
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": engine.weight_version,
        "weight_digest": engine.weights.digest if digest else None,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": getattr(engine, "model_type", "rollfleet-sim"),
        "architectures": list(engine.architectures),
    }
    if not digest:
        del out["weight_digest"]
    if engine.sglang.model_info_0523:
        out.update(
            served_model_name=engine.model_path,  # follows a disk update, as model_path does
            load_format=engine.load_format,
            reasoning_parser=None,
            tool_call_parser=None,
            disaggregation_mode="null",
        )
    return out


def server_info(engine: SimEngine) -> dict:
    load = loads(engine)
    config = engine.config
    scheduler = engine.scheduler
    return {
        "model_path": engine.model_path,
        "tokenizer_path": getattr(engine, "tokenizer_path", BYTE_TOKENIZER_NAME),
        "served_model_name": engine.model_path,
        "tp_size": config["tp_size"],
        "dp_size": config["dp_size"],
        "base_gpu_id": config["base_gpu_id"],
        "mem_fraction_static": config["mem_fraction_static"],
        "load_format": engine.load_format,
        "device": getattr(engine, "device_type", "cpu"),
        "quantization": None,
        "pp_size": 1,
        "ep_size": 1,
        "port": engine.port,
        "host": engine.host,
        "weight_version": engine.weight_version,
        "weight_digest": engine.weights.digest,
        "max_running_requests": engine.slots,
        "max_total_num_tokens": engine.max_total_num_tokens,
        "max_req_input_len": engine.max_req_input_len,
        "context_length": engine.context_length,
        "stream_interval": engine.stream_interval,
        "random_seed": engine.seed,
        "skip_server_warmup": config["skip_server_warmup"],
        "enable_metrics": config["enable_metrics"],
        "disaggregation_mode": "null",
        "status": engine.status,
        "version": getattr(engine, "version", VERSION),
        "kv_events": None,
        "rollfleet_sglang_version": engine.sglang.version,
        "rollfleet_weight_update_session": scheduler.weight_session is not None,
        "internal_states": [
            {
                "dp_rank": 0,
                "last_gen_throughput": load["gen_throughput"],
                "memory_usage": {
                    "weight": 0.0,
                    "kvcache": 0.0,
                    "token_capacity": engine.max_total_num_tokens,
                    "graph": 0.0,
                },
                "paused": scheduler.paused,
                "pause_mode": scheduler.pause_mode or None,
            }
        ],
        **(engine.info_section() if hasattr(engine, "info_section") else _sim_section(engine)),
    }


def _sim_section(engine: SimEngine) -> dict:
    scheduler = engine.scheduler
    output_model = engine.output_model
    return {
        "sim": {
            "token_latency_ms": scheduler.token_latency_s * 1000.0,
            "prefill_latency_ms": scheduler.prefill_latency_s * 1000.0,
            "output_len_dist": output_model.len_dist,
            "output_len_median": output_model.len_median,
            "output_len_sigma": output_model.len_sigma,
            "output_len_max": output_model.len_max,
            "accuracy": output_model.accuracy,
            "num_weights": len(engine.weights.tensors),
            "weight_groups": engine.weight_groups.names,
            "weight_sync_timeout_s": engine.weight_groups.timeout_s,
            "pauses": scheduler.pauses,
        },
    }
