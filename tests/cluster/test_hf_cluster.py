"""agent join --engine hf: a real cluster whose samples come from a model, their logprobs those of the model."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def test_agent_join_with_hf_engines_delivers_samples_whose_logprobs_match_a_recompute(make_cluster, hf_model_dir):
    from agent.hf.model import load_model

    cluster = make_cluster(rollout_batch_size=4, n_samples_per_prompt=4, max_new_tokens=24, dynamic_filter="none")
    cluster.start_coordinator()
    cluster.start_agent("agent-hf", "--model-path", hf_model_dir, "--hf-args=--threads 1", engine="hf")
    with cluster.client() as client:
        batch = client.generate(0)
    samples = batch.samples
    assert len(samples) == 16
    model, _ = load_model(hf_model_dir)
    worst = 0.0
    with torch.no_grad():
        for s in samples:
            assert s.weight_version == "default" and 0 < len(s.response_tokens) == len(s.response_logprobs)
            ids = list(s.prompt_tokens) + list(s.response_tokens)
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
            n = len(s.prompt_tokens)
            ref = torch.log_softmax(logits[n - 1 : -1], -1).gather(1, torch.tensor(s.response_tokens)[:, None])[:, 0]
            worst = max(worst, float((ref - torch.tensor(s.response_logprobs)).abs().max()))
    assert worst < 1e-3
