"""The agent's settings record refuses, when it is made, every value an agent could not run with."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from agent.engine_plan import plan_engines
from agent.settings import AgentSettings, SupervisorSettings
from common.errors import ConfigError

ENGINES = tuple(plan_engines("url", urls=["http://127.0.0.1:30000"]))


def settings(**kw) -> AgentSettings:
    base = dict(
        coordinator="tcp://127.0.0.1:5555",
        data_dir="/tmp/agent",
        engines=ENGINES,
        payload_bind="tcp://127.0.0.1:0",
        advertise_host="127.0.0.1",
    )
    return AgentSettings(**{**base, **kw})


def test_good_settings_are_kept_as_given_with_the_data_dir_a_path_and_the_engines_a_tuple():
    s = settings(engines=list(ENGINES), concurrency=8, metrics_port=0)
    assert s.data_dir == Path("/tmp/agent") and s.engines == ENGINES and s.concurrency == 8
    assert s.supervisor == SupervisorSettings() and s.openai_port == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.concurrency = 9


@pytest.mark.parametrize(
    "kw, why",
    [
        ({"coordinator": "localhost:5555"}, "coordinator (--coordinator)"),
        ({"payload_bind": "tcp://127.0.0.1"}, "payload_bind (--payload-bind)"),
        ({"engines": ()}, "at least one engine"),
        ({"engines": ENGINES * 2}, "duplicate engine name"),
        ({"concurrency": 0}, "concurrency (--concurrency) must be an integer >= 1, got 0"),
        ({"map_size": 0}, "map_size (--map-size)"),
        ({"advertise_host": ""}, "advertise_host (--advertise-host) is empty"),
        ({"metrics_port": 70000}, "metrics_port (--metrics-port): a port is 0..65535"),
        ({"openai_port": None}, "openai_port: a port is 0..65535"),
    ],
)
def test_a_bad_value_is_a_config_error_naming_the_field_and_its_flag(kw, why):
    with pytest.raises(ConfigError, match=re.escape(why)):
        settings(**kw)


@pytest.mark.parametrize(
    "kw, why",
    [
        ({"health_timeout": 0}, "health_timeout must be > 0"),
        ({"restart_window": -1}, "restart_window must be > 0"),
        ({"max_restarts": -1}, "max_restarts (--max-restarts)"),
        ({"api_key": "a b"}, "api_key (--engine-api-key) holds ' '"),
    ],
)
def test_the_supervisors_part_checks_its_own_bounds(kw, why):
    with pytest.raises(ConfigError) as info:
        SupervisorSettings(**kw)
    assert why in str(info.value)
