"""rollfleet-sim: a CPU engine that speaks SGLang's native HTTP API.

It is a real aiohttp server, not a mock: the agent, coordinator and benchmarks drive it exactly
as they drive ``sglang.launch_server`` (the contract is SGLang 0.5.23's native HTTP API by default,
or 0.5.15.post1's with ``--sglang-version 0.5.15``: :mod:`~agent.sim.versions` lists what differs).
It uses the byte vocabulary of
:class:`common.tokenizer.ByteTokenizer` and reports ``tokenizer_path == BYTE_TOKENIZER_NAME``
so clients pick the same tokenizer. Run it with ``python -m agent.sim --port 0`` or
``agent sim-engine --port 0``.

Modules, one role each:

- :mod:`~agent.sim.params`: sampling parameters and ``/generate`` validation; a call expands
  into samples (batch items x ``n``), :mod:`~agent.sim.sample`.
- :mod:`~agent.sim.output`: the output model (arithmetic answers, tool calls for chat prompts that
  declare tools, lengths, logprobs) and the
  response object.
- :mod:`~agent.sim.scheduler`: pause gate, weight-update lock (:mod:`~agent.sim.rwlock`),
  slots, waiting queue, timed decode, abort, pause, weight versions.
- :mod:`~agent.sim.engine`: :class:`SimEngine`, settings, readiness, crash switch;
  :mod:`~agent.sim.info`: the info endpoints' payloads.
- :mod:`~agent.sim.weights`: the tensors the engine holds (``sim.accuracy`` sets the answer
  accuracy; ``weight_digest`` fingerprints them, :mod:`common.weights_digest`) and checkpoints
  on disk; :mod:`~agent.sim.weight_groups`: SGLang's distributed weight-update groups (real gloo,
  and NCCL on a CUDA engine; torch optional); :mod:`~agent.sim.weight_routes`: the weight endpoints.
- :mod:`~agent.sim.weight_checker`: ``/weights_checker`` (SGLang's per-tensor checksums,
  snapshot, compare, reset).
- :mod:`~agent.sim.http`: the aiohttp app and SSE streaming; :mod:`~agent.sim.replies`:
  request bodies and error shapes; :mod:`~agent.sim.auth`: ``--api-key``/``--admin-api-key``;
  :mod:`~agent.sim.versions`: the SGLang release imitated (``--sglang-version``);
  :mod:`~agent.sim.cli` and :mod:`~agent.sim.config`: flags, ``run`` and ``main``.

Faithful to SGLang: request/response fields and ``finish_reason`` shapes, batch and ``n > 1``
expansion (``"{rid}_{i}"`` rids for batches, fresh uuids for ``n > 1``), cumulative SSE chunks
every ``stream_interval`` tokens ending with ``data: [DONE]``, error chunks inside a stream for
request errors, duplicate-rid / empty / out-of-vocabulary / over-long input 400s, unknown
sampling keys 400 with ``{"error": "<message>"}`` (0.5.23 behaviour; ``structural_tag``,
``beam_width``, ``watermark`` and ``choice`` are known keys), control endpoints refusing an
empty or ``null`` body ("Field required"), stop strings and ``stop_token_ids`` (with
``no_stop_trim``), ``min_new_tokens``, ``ignore_eos``, ``logprob_start_len``,
``return_text_in_logprobs``, ``return_prompt_token_ids``, ``weight_versions`` spans (0.5.23;
half-open ``[start, end)`` output-token ranges; ``[{version, 0, 0}]`` for a zero-token finish),
pause modes (an ``abort`` pause re-checking every 1.0 s, running to the end when its client
leaves, ``continue`` waiting for it), ``abort_sent`` (0.5.23), reader/writer lock of weight
updates, weight updates from disk and by broadcast (``init_weights_update_group``,
``update_weights_from_distributed``, ``destroy_weights_update_group``) with SGLang's messages,
weight-update sessions (0.5.23), ``/weights_checker``, ``/get_weights_by_name`` only for the
model classes that implement it (``--architecture``), ``--load-format dummy`` refusing disk loads,
API keys, the 5 s keep-alive, ``/flush_cache`` only when idle (while
paused, waiting requests do not count; a disk update during an ``in_place`` pause with running
requests changes the weights but answers 400 "…the cache was not flushed…"), ``/health`` while
paused, endpoint aliases.

Simplified: one DP rank, no real KV pool (``cached_tokens`` comes from an exact-prompt cache that
flush/weight updates clear; ``max_total_num_tokens`` is nominal); ``retract`` behaves like
``in_place``; an abort of a frozen (paused) running sample finishes it at once instead of after
``continue``; abort credits the tokens produced so far rather than "one more step";
``top_p``/``top_k``/penalties/grammars/``logit_bias`` are validated but do not change the
output (only the ``sim.accuracy`` weight does); weight groups use gloo only, and a
tensor-parallel engine joins with all its ranks from one process; ``load_format:
"flattened_bucket"`` is refused; ``retract`` keeps samples in their slots, but for the cache
flush they count as retracted; stop strings are not held back from intermediate stream chunks;
``top_logprobs_num``, ``token_ids_logprob``, hidden states, routed experts and multimodal inputs are not produced (the
fields are ignored, except ``input_embeds``, which is refused); ``/generate`` answers 503 while
the engine is starting (``--startup-delay``) or ``--unhealthy`` (SGLang opens its port only once
ready); a failed ``/flush_cache`` explains itself in the 400 text; the ``/v1/loads``
``include``/``format`` parameters are ignored (JSON, core fields).
"""

from agent.sim.cli import add_arguments, main, run
from agent.sim.config import CRASH_EXIT_CODE, VERSION
from agent.sim.engine import SimEngine
from agent.sim.http import make_app

__all__ = ["SimEngine", "make_app", "add_arguments", "run", "main", "VERSION", "CRASH_EXIT_CODE"]
