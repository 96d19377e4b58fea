"""Flag types and checks: each bad value is refused with a message naming the bound it broke."""

from __future__ import annotations

import argparse
import math

import pytest

from agent.cli import join_args_values
from common.config import Liveness, RolloutConfig, log_level, message_bytes, number, parse_size
from common.errors import ConfigError
from common.transport import validate_endpoint


@pytest.mark.parametrize(
    "text, size",
    [("65536", 65536), ("64MiB", 64 << 20), ("64 MiB", 64 << 20), ("512KiB", 512 << 10), ("1GiB", 1 << 30),
     ("2MB", 2_000_000), ("100k", 100_000), ("1.5MiB", 3 << 19)],
)  # fmt: skip
def test_sizes_take_units(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["0", "-5", "nan", "64 parsecs", "", "1000"])
def test_message_sizes_below_the_floor_or_malformed_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        message_bytes(text)


def test_numbers_refuse_nan_inf_and_values_out_of_bounds():
    positive = number(float, above=0)
    for bad in ("nan", "inf", "-inf", "0", "-1", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="must be a number > 0"):
            positive(bad)
    assert positive("0.25") == 0.25
    unit = number(float, min=0, max=1)
    assert unit("1") == 1.0 and unit("0") == 0.0
    with pytest.raises(argparse.ArgumentTypeError, match=">= 0 and <= 1, got '2'"):
        unit("2")
    count = number(int, min=1)
    with pytest.raises(argparse.ArgumentTypeError, match="an integer >= 1, got '1.5'"):
        count("1.5")


def test_log_levels_any_case_and_unknown_ones_named():
    assert log_level("debug") == "DEBUG" and log_level(" Warning ") == "WARNING"
    with pytest.raises(argparse.ArgumentTypeError, match="unknown level 'verbose'"):
        log_level("verbose")


def test_liveness_names_the_flags():
    for kwargs, flag in (
        (dict(heartbeat_interval=math.nan), "--heartbeat-interval"),
        (dict(ttl=math.inf), "--agent-ttl"),
        (dict(retire_after=-1.0), "--retire-after"),
    ):
        with pytest.raises(ConfigError, match=flag):
            Liveness(**kwargs)
    with pytest.raises(ConfigError, match="--agent-ttl .* two --heartbeat-interval"):
        Liveness(heartbeat_interval=2.0, ttl=3.0)


def test_batch_shape_is_the_config_without_prefetch():
    shape = RolloutConfig(prefetch=3).batch_shape()
    assert "prefetch" not in shape and shape["rollout_batch_size"] == 32 and shape["reward"] == "math"
    assert RolloutConfig(prefetch=3).batch_shape() == RolloutConfig(prefetch=7).batch_shape()


@pytest.mark.parametrize("address", ["127.0.0.1:5555", "tcp://host", "tcp://:1", "tcp://h:port", "", None])
def test_endpoints_need_tcp_host_and_port(address):
    with pytest.raises(ConfigError, match="--coordinator: expected tcp://HOST:PORT"):
        validate_endpoint(address, "--coordinator")


def test_engine_args_flags_take_their_next_word_as_the_value():
    argv = ["join", "--sim-args", "--unhealthy", "--sglang-args", "--trust-remote-code --x 1", "--engines", "2"]
    assert join_args_values(argv) == [
        "join", "--sim-args=--unhealthy", "--sglang-args=--trust-remote-code --x 1", "--engines", "2",
    ]  # fmt: skip
    assert join_args_values(["--sim-args=--seed 1"]) == ["--sim-args=--seed 1"]
    assert join_args_values(["--sim-args"]) == ["--sim-args"]  # argparse then says the value is missing
