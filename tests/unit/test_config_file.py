"""``--config FILE.toml``: the file's values are checked like flags, named by file and key, and flags win."""

from __future__ import annotations

import pytest

from agent.cli import build_parser as agent_parser
from common.config_file import parse_args_with_config
from common.errors import ConfigError
from coordinator.cli import build_parser as coordinator_parser


def write(tmp_path, text: str) -> str:
    path = tmp_path / "rollfleet.toml"
    path.write_text(text)
    return str(path)


def serve(tmp_path, text: str, *flags: str):
    path = write(tmp_path, text)
    return parse_args_with_config(coordinator_parser(), ["serve", "--config", path, *flags])


def test_file_values_fill_flags_including_required_ones(tmp_path):
    args, effective = serve(
        tmp_path,
        'dataset = "/data/p.jsonl"\ndata_dir = "/var/lib/c"\nmax-new-tokens = 16\nno_sync = true\n'
        "partial_rollout = false\ntemperature = 0.7\n",
    )
    assert (args.dataset, args.data_dir, args.max_new_tokens) == (["/data/p.jsonl"], "/var/lib/c", 16)
    assert args.no_sync is True and args.partial_rollout is False and args.temperature == 0.7
    assert effective["max-new-tokens"] == 16 and effective["dataset"] == ["/data/p.jsonl"]
    assert effective["rollout-batch-size"] == 32  # the built-in default where the file says nothing


def test_command_line_flags_override_the_file(tmp_path):
    args, effective = serve(
        tmp_path,
        'dataset = "a.jsonl"\ndata_dir = "d"\nmax_new_tokens = 16\npartial_rollout = false\n',
        "--max-new-tokens",
        "99",
        "--partial-rollout",
        "--dataset",
        "b.jsonl",
    )
    assert (args.max_new_tokens, args.partial_rollout, args.dataset) == (99, True, ["b.jsonl"])
    assert effective["max-new-tokens"] == 99


def test_repeatable_flags_take_arrays_and_the_command_line_replaces_them(tmp_path):
    path = write(tmp_path, 'coordinator = "tcp://h:1"\ndata_dir = "d"\nengine_url = ["http://a:1", "http://b:2"]\n')
    args, _ = parse_args_with_config(agent_parser(), ["join", "--config", path])
    assert args.engine_url == ["http://a:1", "http://b:2"]
    args, _ = parse_args_with_config(agent_parser(), ["join", "--config", path, "--engine-url", "http://c:3"])
    assert args.engine_url == ["http://c:3"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("max_new_tokns = 1\n", "key 'max_new_tokns': not a flag of coordinator serve (did you mean 'max-new-tokens'"),
        ("max_new_tokens = 0\n", "key 'max_new_tokens': must be an integer >= 1, got '0'"),
        ("max_new_tokens = true\n", "key 'max_new_tokens': expected a string or number, got True"),
        ('no_sync = "yes"\n', "key 'no_sync': expected true or false, got 'yes'"),
        ("[serve]\nreward = 'math'\n", "key 'serve' is a table"),
        ("max_new_tokens = 1\nmax-new-tokens = 2\n", "set twice"),
        ('config = "other.toml"\n', "key 'config': not a flag"),
        ("reward = \n", "not valid TOML"),
    ],
)
def test_mistakes_name_the_file_and_the_key(tmp_path, text, message):
    with pytest.raises(ConfigError) as info:
        serve(tmp_path, text)
    assert message in str(info.value)
    assert str(tmp_path / "rollfleet.toml") in str(info.value)


def test_choices_are_checked(tmp_path):
    path = write(tmp_path, 'coordinator = "tcp://h:1"\ndata_dir = "d"\nengine = "vllm"\n')
    with pytest.raises(ConfigError, match=r"key 'engine': invalid choice 'vllm' \(choose from 'sim', 'hf', 'sglang'\)"):
        parse_args_with_config(agent_parser(), ["join", "--config", path])


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="--config .*nope.toml: no such file"):
        parse_args_with_config(coordinator_parser(), ["serve", "--config", str(tmp_path / "nope.toml")])
