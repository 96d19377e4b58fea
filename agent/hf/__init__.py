"""rollfleet-hf: a torch causal LM (transformers) behind SGLang's native HTTP API.

The hf engine is the sim engine (:mod:`agent.sim`) with a real model in place of the output
model: the same aiohttp app, request validation, pause gate, weight-update lock, slots, waiting
queue, abort semantics, weight endpoints and gloo groups, over an :class:`HFEngine` that has
:class:`~agent.sim.engine.SimEngine`'s duck-typed surface. Run it with
``python -m agent.hf --model-path DIR`` or ``agent hf-engine --model-path DIR``; make a small
model with ``agent make-model DIR`` (:mod:`agent.hf.model`).

Modules, one role each:

- :mod:`~agent.hf.batch`: the running batch, left-padded rows sharing one KV cache
  (prefill, merge, step, select);
- :mod:`~agent.hf.sampler`: next token and logprob per row (temperature, top-k/p, min-p,
  min-new-tokens masking, per-request seeds; the logprob convention);
- :mod:`~agent.hf.decoder`: one step for the whole batch on the model thread (rows leave, step,
  joiners prefill and merge, sample);
- :mod:`~agent.hf.scheduler`: the sim's scheduler whose decode stage is the batch loop;
- :mod:`~agent.hf.output`: outputs that grow token by token, finish checks, text;
- :mod:`~agent.hf.weights`: checked, all-or-nothing copies into the model, and its digest;
- :mod:`~agent.hf.engine`, :mod:`~agent.hf.config`, :mod:`~agent.hf.cli`: the engine, its
  flags, ``run`` and ``main``.

Only :mod:`~agent.hf.config` and :mod:`~agent.hf.cli` import without torch.
"""
