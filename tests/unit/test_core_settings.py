"""The coordinator's settings records are checked when made (coordinator/core_settings.py, ServeSettings in
coordinator/server.py), and the core's roles are handed their parts instead of the core (coordinator/core.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from common.config import Liveness, RolloutConfig
from common.errors import ConfigError
from common.mixture import SourceSpec
from coordinator.core import CoordinatorCore, CoreSettings
from coordinator.evaluation import EvalSpec
from coordinator.server import ServeSettings

ROOT = Path(__file__).resolve().parents[2]
ROLES = ["admission", "batches", "capacity", "evaluation", "lease_book", "oversampling", "rank_shares", "ready",
         "sources", "trainer", "weights"]  # fmt: skip
"""The core's roles and parts."""


def settings(**kw) -> CoreSettings:
    cfg = kw.pop("config", RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=4))
    return CoreSettings(cfg, Liveness(0.25, 3.0, 10.0), kw.pop("sizes", (20,)), "fp", **kw)


def test_core_settings_resolve_the_defaults_and_the_mixtures_datasets():
    s = settings()
    assert s.dataset_size == 20 and s.drops_to_starve == 20 and s.failures_to_starve == 64
    assert [d.name for d in s.datasets] == ["default"]
    mixed = RolloutConfig(mixture=[SourceSpec("a", 2.0).to_dict(), SourceSpec("b").to_dict()])
    s = settings(config=mixed, sizes=[3, 5], starve_after=7)
    assert s.dataset_sizes == (3, 5) and s.dataset_size == 8 and s.failures_to_starve == 7
    assert [d.name for d in s.datasets] == ["a", "b"]
    core = CoordinatorCore(s)
    assert core.training.names == ["a", "b"] and core.dataset_statistics()["a"]["weight"] == 2.0


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"sizes": (20, 20)}, "2 dataset sizes for 1 training datasets"),
        ({"sizes": (-1,)}, "size must be an integer >= 0, got -1"),
        ({"starve_after": 0}, "--starve-after must be an integer >= 1, got 0"),
        ({"starve_after_drops": 1.5}, "--starve-after-drops must be an integer >= 1, got 1.5"),
        ({"over_sampling": 0.5}, r"--over-sampling must be a number >= 1.0 \(1.0: off\), got 0.5"),
        ({"over_sampling": float("nan")}, "--over-sampling must be a number"),
        ({"eval_specs": [EvalSpec("m", 2, "f", 1), EvalSpec("m", 3, "g", 1)]}, r"named twice: \['m'\]"),
    ],
)
def test_core_settings_refuse_a_bad_value_naming_it(kw, match):
    with pytest.raises(ConfigError, match=match):
        settings(**kw)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"data_dir": ""}, "--data-dir must name a directory"),
        ({"bind": "localhost:5"}, "--bind: expected tcp://HOST:PORT"),
        ({"over_sampling": 0.9}, "--over-sampling must be a number >= 1.0"),
        ({"starve_after": -3}, "--starve-after must be an integer >= 1, got -3"),
        ({"metrics_port": 70000}, "--metrics-port must be an integer from 0 to 65535, got 70000"),
        ({"map_size": 10}, "--map-size must be an integer >= 65536, got 10"),
        ({"max_message_bytes": 100}, "--max-message-bytes must be an integer >= 65536"),
        ({"gateways": 65}, "--gateways must be an integer from 0 to 64, got 65"),
        ({"seed": "7"}, "--shuffle-seed must be an integer, got '7'"),
        ({"log_level": "LOUD"}, "--log-level must be one of DEBUG"),
        ({"log_format": "xml"}, "--log-format must be one of text, json"),
    ],
)
def test_serve_settings_refuse_a_bad_value_naming_its_flag(kw, match):
    fields = {"data_dir": "d", "bind": "tcp://127.0.0.1:5555", **kw}
    with pytest.raises(ConfigError, match=match):
        ServeSettings(**fields)
    assert ServeSettings("d", "tcp://127.0.0.1:5555", over_sampling=1.5, metrics_port=0).over_sampling == 1.5


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):  # TYPE_CHECKING imports and lazy ones count too
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return out


@pytest.mark.parametrize("role", ROLES)
def test_a_role_is_handed_its_parts_and_never_reaches_through_the_core(role):
    path = ROOT / "coordinator" / f"{role}.py"
    assert "coordinator.core" not in _imports(path), f"{role}.py imports coordinator/core.py"
    assert "self.core" not in path.read_text(), f"{role}.py reaches through the core"
    assert ".pump(" not in path.read_text(), f"{role}.py pumps: only the core does"
