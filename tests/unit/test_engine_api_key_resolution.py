"""``agent join --engine-api-key``: from the flag, the config file or ``$ROLLFLEET_ENGINE_API_KEY``; never logged."""

from __future__ import annotations

import pytest

from agent.cli import ENGINE_API_KEY_ENV, build_parser, engine_api_key
from common.config_file import parse_args_with_config
from common.errors import ConfigError

BASE = ["join", "--coordinator", "tcp://127.0.0.1:5555", "--data-dir", "/tmp/d"]


def _parse(*argv: str):
    return parse_args_with_config(build_parser(), [*BASE, *argv])


def test_the_flag_wins_over_the_environment_which_is_the_default():
    args, _ = _parse("--engine-api-key", "from-flag")
    assert engine_api_key(args, {ENGINE_API_KEY_ENV: "from-env"}) == "from-flag"
    args, _ = _parse()
    assert engine_api_key(args, {ENGINE_API_KEY_ENV: "from-env"}) == "from-env"
    assert engine_api_key(args, {}) == ""


def test_the_config_file_may_hold_it_and_the_effective_config_never_shows_it(tmp_path):
    path = tmp_path / "agent.toml"
    path.write_text('engine_api_key = "s3cret-key"\n')
    args, effective = _parse("--config", str(path))
    assert engine_api_key(args, {}) == "s3cret-key"
    assert effective["engine-api-key"] == "***"
    assert "s3cret-key" not in repr(effective)
    _, effective = _parse()
    assert effective["engine-api-key"] is None


@pytest.mark.parametrize("key, named", [("two words", "' '"), ("line\nbreak", "'\\n'"), ("clé", "'é'")])
def test_a_key_that_cannot_travel_in_a_header_is_refused_naming_where_it_came_from(key, named):
    args, _ = _parse("--engine-api-key", key)
    with pytest.raises(ConfigError, match="--engine-api-key") as err:
        engine_api_key(args, {})
    assert named in str(err.value)
    args, _ = _parse()
    with pytest.raises(ConfigError, match=ENGINE_API_KEY_ENV):
        engine_api_key(args, {ENGINE_API_KEY_ENV: key})
