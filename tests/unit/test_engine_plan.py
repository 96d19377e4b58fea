"""agent.engine_plan: what a node runs and when a broken engine may restart.  No processes, no
sockets (except that planning sglang engines binds port 0 to pick free ports), no clock."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest

from agent.engine_plan import (
    SIM_MODULE,
    EngineLayout,
    RestartBudget,
    check_positive,
    check_specs,
    default_gpu_ids,
    fix_listen_url,
    layout_from_server_info,
    parse_listen_url,
    plan_engines,
    planned_layout,
    reprobe_delay,
    sglang_command,
    url_host,
)
from common.errors import ConfigError

# ---------------------------------------------------------------- commands and plans


def test_sglang_command():
    argv = sglang_command("/models/qwen", host="0.0.0.0", port=30001, tp_size=2, extra_args=["--enable-metrics"])
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    joined = " ".join(argv)
    for piece in (
        "--model-path /models/qwen",
        "--host 0.0.0.0",
        "--port 30001",
        "--tp-size 2",
        "--base-gpu-id 0",
        "--skip-server-warmup",
    ):
        assert piece in joined
    assert argv[-1] == "--enable-metrics"
    assert sglang_command("m", host="h", port=1, tp_size=1, module="x.y")[2] == "x.y"
    for bad in (dict(tp_size=0), dict(port=0), dict(port=65536)):
        with pytest.raises(ConfigError):
            sglang_command("m", **{"host": "h", "port": 1, "tp_size": 1, **bad})
    with pytest.raises(ConfigError):
        sglang_command("", host="h", port=1, tp_size=1)


def test_plan_sglang_ports_gpus_env(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    specs = plan_engines(
        "sglang",
        count=3,
        model_path="/m",
        tp_size=2,
        gpu_ids=[4, 5, 6, 7, 2, 3, 0],
        sglang_args=["--dtype", "bfloat16"],
    )
    assert [s.name for s in specs] == ["sglang-0", "sglang-1", "sglang-2"]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["4,5", "6,7", "2,3"]
    assert [s.gpu_ids for s in specs] == [[4, 5], [6, 7], [2, 3]]
    for s in specs:
        assert s.kind == "sglang"
        assert "PYTORCH_CUDA_ALLOC_CONF" not in s.env
        assert s.env["PATH"] == os.environ["PATH"]
        assert s.argv[s.argv.index("--tp-size") + 1] == "2"
        assert s.argv[s.argv.index("--base-gpu-id") + 1] == "0"
        assert s.argv[-2:] == ["--dtype", "bfloat16"]
        port = int(s.argv[s.argv.index("--port") + 1])
        assert s.url == f"http://127.0.0.1:{port}"
    ports = [int(s.argv[s.argv.index("--port") + 1]) for s in specs]
    assert len(set(ports)) == 3
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"  # ours untouched


def test_plan_sglang_too_few_gpus():
    with pytest.raises(ConfigError) as ei:
        plan_engines("sglang", count=2, model_path="/m", tp_size=2, gpu_ids=[0, 1, 2])
    msg = str(ei.value)
    assert "need 4" in msg and "only 3" in msg and "tp_size 2" in msg
    with pytest.raises(ConfigError):
        plan_engines("sglang", count=1, tp_size=1, gpu_ids=[0])  # no model path
    with pytest.raises(ConfigError):
        plan_engines("sglang", model_path="/m", gpu_ids=[1, 1])


def test_plan_sglang_default_gpus_from_env(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    specs = plan_engines("sglang", count=2, model_path="/m")
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["3", "5"]


def test_default_gpu_ids():
    assert default_gpu_ids(3, None) == [0, 1, 2]
    assert default_gpu_ids(1, " 2, 7 ,") == [2, 7]
    assert default_gpu_ids(2, "") == []
    with pytest.raises(ConfigError, match="pass gpu_ids explicitly"):
        default_gpu_ids(1, "GPU-1234")


def test_plan_url_and_sim():
    specs = plan_engines("url", urls=["http://10.0.0.1:30000/", "http://10.0.0.2:30000"])
    assert [(s.name, s.kind, s.url, s.argv) for s in specs] == [
        ("url-0", "url", "http://10.0.0.1:30000", None),
        ("url-1", "url", "http://10.0.0.2:30000", None),
    ]
    for bad in (dict(urls=[]), dict(urls=["10.0.0.1:30000"]), dict(urls=["ftp://x:1"])):
        with pytest.raises(ConfigError):
            plan_engines("url", **bad)
    with pytest.raises(ConfigError):
        plan_engines("sim", urls=["http://x:1"])
    with pytest.raises(ConfigError):
        plan_engines("vllm")
    with pytest.raises(ConfigError):
        plan_engines("sim", count=0)
    sims = plan_engines("sim", count=2, sim_args=["--startup-delay", "1"])
    assert [s.name for s in sims] == ["sim-0", "sim-1"]
    assert sims[0].url is None
    assert SIM_MODULE == "agent.sim"
    assert sims[0].argv == [
        sys.executable, "-m", "agent.sim", "--host", "127.0.0.1", "--port", "0", "--startup-delay", "1",
    ]  # fmt: skip
    assert sims[0].argv is not sims[1].argv  # a caller editing one spec leaves the other alone


def test_check_specs():
    s = plan_engines("sim")[0]
    check_specs([s, dataclasses.replace(s, name="sim-1")])
    bad_lists = [
        [],
        [s, s],  # duplicate name
        [dataclasses.replace(s, name="../x")],
        [dataclasses.replace(s, kind="vllm")],
        [dataclasses.replace(s, argv=None)],
        [dataclasses.replace(s, kind="url", argv=None)],  # url engine without a url
        [dataclasses.replace(s, kind="sglang")],  # sglang engine without its url
    ]
    for specs in bad_lists:
        with pytest.raises(ConfigError):
            check_specs(specs)


def test_check_positive_names_the_field():
    check_positive(a=1, b=0.1)
    with pytest.raises(ConfigError, match="health_timeout must be > 0, got 0"):
        check_positive(start_timeout=1.0, health_timeout=0)


# ---------------------------------------------------------------- listen URLs


def test_listen_urls_become_connectable():
    assert url_host("0.0.0.0") == "127.0.0.1"
    assert url_host("") == "127.0.0.1"
    assert url_host("::") == "[::1]"
    assert url_host("fe80::1") == "[fe80::1]"
    assert url_host("10.1.2.3") == "10.1.2.3"
    assert fix_listen_url("http://0.0.0.0:4000") == "http://127.0.0.1:4000"
    assert fix_listen_url("http://[::]:4000/") == "http://[::1]:4000"
    assert fix_listen_url("http://10.1.2.3:4000/") == "http://10.1.2.3:4000"
    log = b"loading...\nrollfleet-sim listening on http://0.0.0.0:41234\nready\n"
    assert parse_listen_url(log) == "http://127.0.0.1:41234"
    assert parse_listen_url(b"rollfleet-sim listening on https://h:1/\n") == "https://h:1"
    assert parse_listen_url(b"loading...\nrollfleet-sim listen") is None


# ---------------------------------------------------------------- restart policy


def test_restart_budget_backoff_doubles_and_caps():
    budget = RestartBudget(max_restarts=100, window=1e9)
    delays = []
    for t in range(9):
        delays.append(budget.next_delay(now=float(t)))
        budget.record(now=float(t))
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]


def test_restart_budget_spent_within_window_then_recovers():
    budget = RestartBudget(max_restarts=2, window=60.0)
    assert budget.next_delay(0.0) == 0.5
    budget.record(0.0)
    assert budget.next_delay(10.0) == 1.0
    budget.record(10.0)
    assert budget.next_delay(59.0) is None  # two restarts in the last 60 s: retire
    assert budget.recent(59.0) == 2
    assert budget.next_delay(60.5) == 1.0  # the first one left the window
    assert budget.recent(60.5) == 1
    assert budget.next_delay(70.5) == 0.5  # both have
    assert budget.recent(70.5) == 0


def test_a_refunded_restart_counts_neither_for_retiring_nor_in_the_total():
    budget = RestartBudget(max_restarts=1, window=60.0)
    for t in range(5):  # five restarts that never started the engine (its log on a full disk)
        budget.record(float(t))
        budget.refund()
    assert budget.next_delay(5.0) == 0.5 and budget.total == 0
    budget.record(6.0)
    assert budget.next_delay(7.0) is None and budget.total == 1


def test_restart_budget_zero_means_never():
    assert RestartBudget(max_restarts=0, window=1.0).next_delay(0.0) is None
    with pytest.raises(ConfigError):
        RestartBudget(max_restarts=-1, window=1.0)
    with pytest.raises(ConfigError):
        RestartBudget(max_restarts=1, window=0)


def test_reprobe_delay():
    assert [reprobe_delay(a, 5.0) for a in range(6)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert [reprobe_delay(a, 0.2) for a in range(4)] == [0.5, 1.0, 2.0, 2.0]  # at least 2 s cap
    assert reprobe_delay(10, 300.0) == 30.0  # at most the restart cap
    assert reprobe_delay(100_000, 5.0) == 5.0  # a server down for days does not overflow


# ---------------------------------------------------------------- API key and parallel layout


def test_an_api_key_launches_every_engine_kind_with_it(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    (sim,) = plan_engines("sim", api_key="k-1")
    (sglang,) = plan_engines("sglang", model_path="/m", api_key="k-1")
    (hf,) = plan_engines("hf", model_path="/m", api_key="k-1")
    for spec in (sim, sglang, hf):
        i = spec.argv.index("--api-key")
        assert spec.argv[i + 1] == "k-1", spec.argv
    assert "--api-key" not in plan_engines("sim")[0].argv  # no key: an open engine, as before


def test_the_layout_comes_from_server_info_and_the_plan_fills_what_it_lacks(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    (sglang,) = plan_engines("sglang", model_path="/m", tp_size=4)
    (url,) = plan_engines("url", urls=["http://h:1"])
    assert planned_layout(sglang) == EngineLayout(tp_size=4, device="cuda")
    assert planned_layout(url) == EngineLayout()  # tp 1, dp 1: what the agent assumed before
    info = {"tp_size": 2, "dp_size": 2, "quantization": "fp8", "device": "cuda", "enable_dp_attention": True}
    assert layout_from_server_info(info, planned_layout(url)) == EngineLayout(2, 2, "fp8", "cuda", True, True)
    # SGLang says null for no quantization; a missing or nonsense size keeps the planned one.
    bare = layout_from_server_info({"quantization": None, "tp_size": "2", "dp_size": 0}, planned_layout(sglang))
    assert (bare.tp_size, bare.dp_size, bare.quantization, bare.device, bare.from_server) == (4, 1, None, "cuda", True)
