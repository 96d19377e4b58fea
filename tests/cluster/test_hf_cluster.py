"""agent join --engine hf: a real cluster whose samples come from a model, their logprobs those of the model."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def recompute_gap(model, sample) -> float:
    """The largest difference between a sample's response logprobs and the model's recompute of them."""
    ids = list(sample.prompt_tokens) + list(sample.response_tokens)
    logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    n = len(sample.prompt_tokens)
    ref = torch.log_softmax(logits[n - 1 : -1], -1).gather(1, torch.tensor(sample.response_tokens)[:, None])[:, 0]
    return float((ref - torch.tensor(sample.response_logprobs)).abs().max())


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
            worst = max(worst, recompute_gap(model, s))
    assert worst < 1e-3


def test_chat_rows_through_the_models_chat_template_reach_the_trainer_with_the_templates_tokens(
    make_cluster, hf_model_dir, tmp_path
):
    """A chat-format dataset on an hf engine whose tokenizer has a chat template: every sample's prompt
    is its row rendered by that template (with the generation prompt), and its logprobs are the model's."""
    import json

    from agent.hf.model import load_model

    rows = tmp_path / "chat.jsonl"
    with rows.open("w") as f:
        for i in range(40):
            messages = [{"role": "user", "content": f"{i % 10}+{i // 10}="}]
            if i % 2:
                messages.insert(0, {"role": "system", "content": "Answer in \\boxed{}."})
            f.write(json.dumps({"prompt": messages, "label": str(i % 10 + i // 10)}) + "\n")
    cluster = make_cluster(
        dataset=rows, rollout_batch_size=4, n_samples_per_prompt=2, max_new_tokens=16, dynamic_filter="none"
    )
    cluster.start_coordinator("--tokenizer", hf_model_dir)
    cluster.start_agent("agent-hf", "--model-path", hf_model_dir, "--hf-args=--threads 1", engine="hf")
    with cluster.client() as client:
        samples = [s for step in range(2) for s in client.generate(step).samples]
    assert len(samples) == 16
    model, tokenizer = load_model(hf_model_dir)
    worst = 0.0
    with torch.no_grad():
        for s in samples:
            messages = s.metadata["prompt"]
            assert isinstance(messages, list) and messages[-1]["role"] == "user"
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            assert text.endswith("<|assistant|>\n")
            assert list(s.prompt_tokens) == tokenizer.encode(text, add_special_tokens=False)
            worst = max(worst, recompute_gap(model, s))
    assert worst < 1e-3


def test_an_openai_agent_loop_on_the_hf_engine_is_rendered_by_the_models_template_and_recorded(
    make_cluster, hf_model_dir
):
    """examples/tools/openai_calculator.py (plain openai client code) on an hf engine: the agent renders with the
    model's own chat template (its tool list included), and the recorded tokens' logprobs are the model's."""
    from agent.chat_render import render_bytes
    from agent.hf.model import load_model
    from examples.tools.openai_calculator import TOOLS

    cluster = make_cluster(
        generate="examples.tools.openai_calculator:rollout",
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        max_new_tokens=24,
        dynamic_filter="none",
    )
    cluster.start_coordinator()
    cluster.start_agent("agent-hf", "--model-path", hf_model_dir, "--hf-args=--threads 1", engine="hf")
    with cluster.client() as client:
        batch = client.generate(0)
    model, _ = load_model(hf_model_dir)
    assert len(batch.samples) == 4
    with torch.no_grad():
        for s in batch.samples:
            question = [{"role": "user", "content": s.metadata["prompt"]}]
            assert s.prompt_tokens.tolist() == render_bytes(question, TOOLS, True)
            assert s.metadata["openai_calls"] >= 1 and 0 < sum(s.loss_mask) <= 24
            ids = list(s.prompt_tokens) + list(s.response_tokens)
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
            n = len(s.prompt_tokens)
            ref = torch.log_softmax(logits[n - 1 : -1], -1).gather(1, torch.tensor(s.response_tokens)[:, None])[:, 0]
            mask = torch.tensor(s.loss_mask.tolist(), dtype=torch.bool)
            assert float((ref - torch.tensor(s.response_logprobs))[mask].abs().max()) < 1e-3
