"""HFEngine: a Hugging Face causal LM behind the sim's SGLang HTTP layer.

The engine has the duck-typed surface of :class:`agent.sim.engine.SimEngine`, so
:func:`agent.sim.http.make_app`, the sim's request validation (:func:`agent.sim.params.parse_generate`,
with the model's vocabulary and tokenizer), its weight endpoints (:mod:`agent.sim.weight_routes`,
:class:`agent.sim.weight_groups.WeightGroups`: gloo groups, and NCCL groups on a CUDA device) and its
response objects serve it unchanged. What differs: :class:`agent.hf.scheduler.HFScheduler`
decodes with the model in batches, and :meth:`HFEngine.apply_weights` copies tensors into the
model (:mod:`agent.hf.weights`).

Every use of the model happens on one worker thread (``self.executor``, one worker): decode
steps, weight copies (``apply_weights`` submits the copy there and waits for it, so it runs
between two steps), and the start-up load. The model is loaded before the port opens, so the
engine is ready as soon as it listens (SGLang does the same).

``/model_info`` reports ``tokenizer_path`` = the model directory the engine started from (clients
load it with ``AutoTokenizer``), ``weight_digest`` = :attr:`agent.hf.weights.ModelWeights.digest` and
``architectures`` = the model config's (so ``/get_weights_by_name`` answers for a Llama, as SGLang's
does, and not for a Qwen2). ``--sglang-version`` and the other SGLang flags act as on the sim
(:func:`agent.sim.versions.configure`); ``/server_info`` reports ``device`` ``cpu`` or ``cuda``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from agent.hf.config import VERSION, engine_config
from agent.hf.decoder import Decoder
from agent.hf.output import HFOutputs
from agent.hf.scheduler import HFScheduler
from agent.hf.weights import ONLINE_FAILURE, ModelWeights
from agent.sim.config import CRASH_EXIT_CODE
from agent.sim.info import ThroughputMeter
from agent.sim.params import parse_generate
from agent.sim.sample import Sample
from agent.sim.versions import configure
from agent.sim.weight_groups import WeightGroups
from agent.sim.weights import WeightError

log = logging.getLogger("rollfleet.hf_engine")


def resolve_device(name: str) -> str:
    """``auto`` is ``cuda`` when torch sees a GPU, else ``cpu``; other names are checked against torch."""
    import torch

    from common.errors import ConfigError

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {name}: torch sees no CUDA device (torch {torch.__version__})")
        index = int(name[5:]) if name.startswith("cuda:") else 0
        if index >= torch.cuda.device_count():
            raise ConfigError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s)")
    return name


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


class HFEngine:
    """One model-backed engine: built from parsed flags (``args``) and/or keyword overrides named after flags."""

    version = VERSION
    model_type = "rollfleet-hf"

    def __init__(self, args: argparse.Namespace | None = None, **overrides: Any):
        import torch
        from transformers.utils import logging as transformers_logging

        from agent.hf.model import load_model

        transformers_logging.disable_progress_bar()  # the engine log is for the engine's own lines
        cfg = engine_config(args, overrides)
        self.config = {
            **cfg,
            "tp_size": 1,
            "dp_size": 1,
            "base_gpu_id": 0,
            "mem_fraction_static": None,
            "load_format": cfg["load_format"],
            "skip_server_warmup": True,
            "enable_metrics": False,
        }
        self.host: str = cfg["host"]
        self.port: int = cfg["port"]
        self.slots: int = int(cfg["slots"])
        self.stream_interval: int = int(cfg["stream_interval"])
        self.seed: int = int(cfg["seed"])
        self.health_timeout: float = float(cfg["health_timeout"])
        self.crash_after: int = int(cfg["crash_after_requests"] or 0)
        self.crash_fn: Callable[[int], Any] = os._exit
        self.model_path: str = str(cfg["model_path"])
        self.tokenizer_path: str = os.path.abspath(self.model_path)
        if cfg["threads"]:
            torch.set_num_threads(int(cfg["threads"]))
        self.device = resolve_device(cfg["device"])
        self.device_type = "cuda" if self.device.startswith("cuda") else "cpu"  # /server_info's device
        self.dtype: str = cfg["dtype"]
        # One thread for every use of the model: loads, steps and weight copies never overlap.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-model")
        self.model, self.tokenizer = self.executor.submit(
            load_model, self.model_path, device=self.device, dtype=self.dtype
        ).result()
        model_config = self.model.config
        self.architectures = list(getattr(model_config, "architectures", None) or [type(self.model).__name__])
        self.vocab_size: int = int(model_config.vocab_size)
        self.context_length: int = int(cfg["context_length"] or model_config.max_position_embeddings)
        self.max_req_input_len = self.context_length - 1
        self.max_total_num_tokens = self.slots * self.context_length  # nominal: the cache grows as needed
        pad_id = self.tokenizer.pad_token_id
        if pad_id is None:
            pad_id = 0
        eos_ids = _eos_ids(self.model, self.tokenizer)
        self.weights = ModelWeights(self.model)
        self.outputs = HFOutputs(self.tokenizer, eos_ids, self.vocab_size)
        self.scheduler = HFScheduler(
            slots=self.slots,
            weight_version=str(cfg["weight_version"]),
            outputs=self.outputs,
            decoder=Decoder(self.model, torch.device(self.device), int(pad_id), self.seed),
            executor=self.executor,
            device=torch.device(self.device),
        )
        configure(self, cfg)
        if self.device.startswith("cuda"):
            # NCCL groups: a wait past --weight-sync-timeout raises in the waiting thread and aborts the
            # communicator, instead of NCCL's watchdog ending this process (agent.sim.weight_groups).
            os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
        self.weight_groups = WeightGroups(
            timeout_s=float(cfg["weight_sync_timeout"]), device=self.device, engine="rollfleet-hf"
        )
        self.throughput = ThroughputMeter()
        self.ok_generate_calls = 0

    @property
    def weight_version(self) -> str:
        return self.scheduler.weight_version

    @property
    def status(self) -> str:
        return "Up"

    def is_ready(self) -> bool:
        return True

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def new_samples(self, data: dict) -> tuple[list[Sample], bool]:
        """Validate a ``/generate`` body against the model's vocabulary and register its samples' rids."""
        samples, multi = parse_generate(
            data,
            live_rids=self.scheduler.live_rids,
            context_length=self.context_length,
            default_stream_interval=self.stream_interval,
            vocab_size=self.vocab_size,
            encode=self._encode,
        )
        self.scheduler.live_rids.update(s.rid for s in samples)
        return samples, multi

    def apply_weights(self, named: dict[str, Any], *, replace: bool) -> None:
        """Copy ``named`` into the model on the model thread (between two steps), all or nothing.

        ``replace`` (a disk update) and a broadcast bucket both copy only the tensors named; a
        bad name or shape refuses the whole call with a WeightError (a bucket's in SGLang's words).
        """
        try:
            pairs = self.weights.check(named)
        except WeightError as exc:
            raise exc if replace else WeightError(ONLINE_FAILURE.format(exc)) from None
        self.executor.submit(self.weights.copy, pairs).result()

    def info_section(self) -> dict:
        """The ``hf`` section of ``/server_info`` (in place of the sim's ``sim`` section)."""
        scheduler = self.scheduler
        return {
            "hf": {
                "device": self.device,
                "dtype": self.dtype,
                "vocab_size": self.vocab_size,
                "parameters": sum(p.numel() for p in self.model.parameters()),
                "decode_steps": scheduler.steps,
                "max_batch": scheduler.max_batch,
                "weight_groups": self.weight_groups.names,
                "weight_sync_timeout_s": self.weight_groups.timeout_s,
            }
        }

    def crash(self, why: str) -> None:
        log.error("rollfleet-hf crashing on purpose (%s): exit %d", why, CRASH_EXIT_CODE)
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            self.crash_fn(CRASH_EXIT_CODE)

    def shutdown(self) -> None:
        """Abort everything, stop the batch loop, leave the groups and release the model thread."""
        self.scheduler.shutdown()
        self.weight_groups.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
