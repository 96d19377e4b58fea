"""agent.supervisor with real sim-engine children: start, health checks, restarts, retirement, stop.

Planning is tested without processes in tests/unit/test_engine_plan.py."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from agent.engine_client import EngineClient
from agent.engine_plan import SIM_MODULE, EngineSpec, plan_engines
from agent.supervisor import EngineSupervisor
from common.errors import Closed, ConfigError, EngineStartError, EngineUnavailable
from harness.polling import wait_for_async

# ---------------------------------------------------------------- helpers

_SEEN_PIDS: set[int] = set()


@pytest.fixture(autouse=True)
def _reap_strays():
    """Safety net: kill (by pid/process group, never by name) any child a test left behind."""
    yield
    for pid in list(_SEEN_PIDS):
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    _SEEN_PIDS.clear()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie still answers kill(0); reap it if it is ours
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


def _track(sup: EngineSupervisor) -> dict[str, int]:
    pids = sup.pids()
    _SEEN_PIDS.update(pids.values())
    return pids


async def _get_health(url: str) -> int:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/health_generate", timeout=aiohttp.ClientTimeout(total=5)) as r:
            return r.status


def _sim(name: str, *args: str) -> EngineSpec:
    spec = plan_engines("sim", sim_args=args)[0]
    return dataclasses.replace(spec, name=name)


def _sup(specs, tmp_path: Path, events: list | None = None, **kw) -> EngineSupervisor:
    kw.setdefault("start_timeout", 20.0)
    kw.setdefault("health_interval", 0.3)
    kw.setdefault("health_timeout", 2.0)
    on_change = (lambda n, s: events.append((n, s))) if events is not None else None
    return EngineSupervisor(specs, log_dir=tmp_path / "logs", on_change=on_change, **kw)


# ---------------------------------------------------------------- construction


def test_supervisor_rejects_bad_specs(tmp_path):
    s = plan_engines("sim")[0]
    with pytest.raises(ConfigError):
        EngineSupervisor([s, s], log_dir=tmp_path)
    with pytest.raises(ConfigError):
        EngineSupervisor([], log_dir=tmp_path)
    with pytest.raises(ConfigError):
        EngineSupervisor([dataclasses.replace(s, name="../x")], log_dir=tmp_path)


# ---------------------------------------------------------------- live sim engines


@pytest.mark.timeout(40)
async def test_two_sim_engines_become_healthy_and_stop_cleanly(tmp_path):
    events: list = []

    sup = _sup(plan_engines("sim", count=2), tmp_path, events)
    try:
        await sup.start()
        pids = _track(sup)
        assert sorted(pids) == ["sim-0", "sim-1"]
        assert [sup.state(n) for n in ("sim-0", "sim-1")] == ["healthy", "healthy"]
        healthy = sup.healthy()
        assert [e.name for e in healthy] == ["sim-0", "sim-1"]
        assert healthy[0].url != healthy[1].url
        for e in healthy:
            assert e.url.startswith("http://127.0.0.1:")
            assert await _get_health(e.url) == 200
        assert sorted(events) == [("sim-0", "healthy"), ("sim-1", "healthy")]
        log = (tmp_path / "logs" / "sim-0.log").read_text()
        assert "rollfleet-sim listening on http://" in log
        # the engine tasks are named and owned by the supervisor
        names = {t.get_name() for t in asyncio.all_tasks()}
        assert {"engine-sim-0", "engine-sim-1"} <= names
    finally:
        await sup.stop()
        await sup.stop()  # idempotent
    for pid in pids.values():
        assert not _alive(pid)
    with pytest.raises(ProcessLookupError):
        os.kill(pids["sim-0"], 0)
    assert sup.pids() == {} and sup.healthy() == []
    assert not any(t.get_name().startswith("engine-") for t in asyncio.all_tasks())


@pytest.mark.timeout(30)
async def test_sglang_kind_launches_through_same_path(tmp_path):
    specs = plan_engines("sglang", model_path="/nonexistent/model", gpu_ids=[3], sglang_module=SIM_MODULE)

    sup = _sup(specs, tmp_path)
    try:
        await sup.start()
        _track(sup)
        (e,) = sup.healthy()
        assert e.name == "sglang-0" and e.url == specs[0].url
        assert await _get_health(e.url) == 200
    finally:
        await sup.stop()


@pytest.mark.timeout(30)
async def test_startup_delay_is_waited_for(tmp_path):
    sup = _sup([_sim("slow", "--startup-delay", "1")], tmp_path)
    try:
        t0 = time.monotonic()
        task = asyncio.create_task(sup.start())
        await asyncio.sleep(0.3)
        assert sup.state("slow") == "starting" and sup.healthy() == []
        await task
        assert time.monotonic() - t0 >= 1.0
        _track(sup)
        assert sup.state("slow") == "healthy"
    finally:
        await sup.stop()


@pytest.mark.timeout(30)
async def test_unhealthy_only_engine_fails_start(tmp_path):
    sup = _sup([_sim("sick", "--unhealthy")], tmp_path, start_timeout=2.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(EngineStartError) as ei:
            await sup.start()
        assert time.monotonic() - t0 < 10
        msg = str(ei.value)
        assert "sick" in msg and "http://127.0.0.1:" in msg and "sick.log" in msg
        assert sup.state("sick") == "retired" and sup.pids() == {}
    finally:
        await sup.stop()


@pytest.mark.timeout(30)
async def test_unhealthy_engine_retired_while_other_starts(tmp_path):
    events: list = []

    sup = _sup([_sim("good"), _sim("sick", "--unhealthy")], tmp_path, events, start_timeout=2.0)
    try:
        await sup.start()
        pids = _track(sup)
        assert sup.state("good") == "healthy" and sup.state("sick") == "retired"
        assert list(pids) == ["good"]
        assert [e.name for e in sup.healthy()] == ["good"]
        assert ("sick", "retired") in events and ("good", "healthy") in events
    finally:
        await sup.stop()


@pytest.mark.timeout(30)
async def test_exit_during_start_names_exit_code_and_log_tail(tmp_path):
    sup = _sup([_sim("broken", "--no-such-flag")], tmp_path)
    try:
        with pytest.raises(EngineStartError) as ei:
            await sup.start()
        msg = str(ei.value)
        assert "broken" in msg and "exit code 2" in msg
        assert "--no-such-flag" in msg  # argparse's complaint, from the log tail
    finally:
        await sup.stop()


@pytest.mark.timeout(40)
async def test_sigkill_child_goes_down_then_healthy_with_new_pid(tmp_path):
    events: list = []

    sup = _sup([_sim("e")], tmp_path, events)
    try:
        await sup.start()
        old = _track(sup)["e"]
        old_url = sup.healthy()[0].url
        os.kill(old, signal.SIGKILL)
        await wait_for_async(lambda: sup.state("e") == "down", 5, "down")
        assert sup.healthy() == []
        await wait_for_async(lambda: sup.state("e") == "healthy", 15, "healthy again")
        new = _track(sup)["e"]
        assert new != old and not _alive(old)
        url = sup.healthy()[0].url
        assert await _get_health(url) == 200
        assert events == [("e", "healthy"), ("e", "down"), ("e", "healthy")]
        log = (tmp_path / "logs" / "e.log").read_text()
        assert log.count("=== rollfleet supervisor") == 2  # appended, one header per launch
        del old_url
    finally:
        await sup.stop()


@pytest.mark.timeout(40)
async def test_crash_budget_exhausted_retires(tmp_path):
    events: list = []

    sup = _sup([_sim("e")], tmp_path, events, max_restarts=1, restart_window=60)
    try:
        await sup.start()
        os.kill(_track(sup)["e"], signal.SIGKILL)
        await wait_for_async(lambda: sup.state("e") == "down", 5, "down")
        await wait_for_async(lambda: sup.state("e") == "healthy", 15, "restarted")
        url = sup.healthy()[0].url
        async with aiohttp.ClientSession() as s:  # crash it the sim engine's way
            try:
                async with s.post(url + "/rollfleet/crash", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    await r.read()
            except aiohttp.ClientError:
                pass
        await wait_for_async(lambda: sup.state("e") == "retired", 10, "retired")
        assert sup.pids() == {} and sup.healthy() == []
        assert events == [("e", "healthy"), ("e", "down"), ("e", "healthy"), ("e", "down"), ("e", "retired")]
        await asyncio.sleep(1.0)
        assert sup.state("e") == "retired" and sup.pids() == {}  # never restarted
    finally:
        await sup.stop()


@pytest.mark.timeout(40)
async def test_hung_engine_reported_failure_and_paused_checks(tmp_path):
    events: list = []

    # long interval: only report_failure triggers a check
    sup = _sup([_sim("e")], tmp_path, events, health_interval=60, health_timeout=0.5)
    try:
        await sup.start()
        pid = _track(sup)["e"]
        sup.pause_health_checks()
        os.kill(pid, signal.SIGSTOP)  # hung: the port is open but nothing answers
        sup.report_failure("e", "connection reset")
        await asyncio.sleep(1.0)
        assert sup.state("e") == "healthy"  # checks are paused
        sup.resume_health_checks()  # the deferred check runs now
        await wait_for_async(lambda: sup.state("e") == "down", 5, "down")
        await wait_for_async(lambda: sup.state("e") == "healthy", 15, "healthy again")
        assert _track(sup)["e"] != pid and not _alive(pid)
    finally:
        await sup.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(40)
async def test_url_engine_goes_down_and_comes_back(tmp_path):
    port = _free_port()
    cmd = [sys.executable, "-m", SIM_MODULE, "--host", "127.0.0.1", "--port", str(port)]
    events: list = []

    def launch():
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        _SEEN_PIDS.add(p.pid)
        return p

    proc = launch()
    sup = _sup(
        plan_engines("url", urls=[f"http://127.0.0.1:{port}"]),
        tmp_path,
        events,
        health_interval=0.2,
        health_timeout=1.0,
        max_restarts=0,
    )
    try:
        await sup.start()
        assert sup.state("url-0") == "healthy" and sup.pids() == {}
        proc.kill()
        proc.wait()
        await wait_for_async(lambda: sup.state("url-0") == "down", 5, "down")
        await asyncio.sleep(0.5)
        assert sup.state("url-0") == "down"  # not retired, despite max_restarts=0
        proc = launch()
        await wait_for_async(lambda: sup.state("url-0") == "healthy", 15, "back up")
        assert events == [("url-0", "healthy"), ("url-0", "down"), ("url-0", "healthy")]
    finally:
        await sup.stop()
        proc.kill()
        proc.wait()


@pytest.mark.timeout(30)
async def test_stop_during_start_and_run_returns(tmp_path):
    sup = _sup([_sim("slow", "--startup-delay", "30")], tmp_path)
    try:
        start = asyncio.create_task(sup.start())
        await wait_for_async(lambda: sup.pids() != {}, 10, "launched")
        pid = _track(sup)["slow"]
        await sup.stop(timeout=2.0)
        with pytest.raises(Closed):
            await start
        assert not _alive(pid)
    finally:
        await sup.stop()

    sup = _sup([_sim("e")], tmp_path)
    try:
        await sup.start()
        pid = _track(sup)["e"]
        runner = asyncio.create_task(sup.run(), name="supervisor-run")
        await asyncio.sleep(0.2)
        assert not runner.done()
        await sup.stop()
        await asyncio.wait_for(runner, 5)  # returns once stopped
        assert not _alive(pid)
    finally:
        await sup.stop()


async def test_reported_failure_of_a_healthy_engine_is_answered_with_healthy(tmp_path):
    """A transient request error: the caller stops using the engine, so it must hear when it is fine."""
    events: list = []

    sup = _sup([_sim("e0")], tmp_path, events)
    try:
        await sup.start()
        _track(sup)
        events.clear()
        sup.report_failure("e0", "connection reset by peer")
        await wait_for_async(lambda: ("e0", "healthy") in events, 15, "a healthy verdict after the report")
        assert sup.state("e0") == "healthy" and ("e0", "down") not in events
    finally:
        await sup.stop()


@pytest.mark.timeout(40)
async def test_failure_reported_as_the_engine_dies_is_not_answered_for_its_stale_restart(tmp_path):
    """A request fails just as the engine dies; the restarted engine has launch weights (``stale``).

    The report was about the old process: the restart must not be announced healthy on its account.
    """
    events: list = []
    launches: list[str] = []

    async def prepare(name: str, url: str) -> str:
        launches.append(url)
        return "healthy" if len(launches) == 1 else "stale"  # behind the fleet's weights after a restart

    sup = _sup([_sim("e")], tmp_path, events, prepare=prepare)
    try:
        await sup.start()
        pid = _track(sup)["e"]
        sup.pause_health_checks()  # as during a weight update: the report waits, exit detection does not
        sup.report_failure("e", "connection reset by peer")
        os.kill(pid, signal.SIGKILL)
        await wait_for_async(lambda: sup.state("e") == "stale", 15, "restarted, stale")
        _track(sup)
        sup.resume_health_checks(force=True)
        await asyncio.sleep(1.5)  # several health intervals: a check of the restarted engine ran
        assert sup.state("e") == "stale" and sup.healthy() == []
        assert events == [("e", "healthy"), ("e", "down"), ("e", "stale")]
    finally:
        await sup.stop()


@pytest.mark.timeout(30)
async def test_stop_before_engine_tasks_ran_ends_start(tmp_path):
    sup = _sup([_sim("e")], tmp_path)
    start = asyncio.create_task(sup.start())
    await asyncio.sleep(0)  # start() has spawned the engine task; it has not run yet
    await sup.stop()
    with pytest.raises(Closed):
        await asyncio.wait_for(start, 5)
    assert sup.pids() == {}


@pytest.mark.timeout(40)
async def test_health_probes_share_the_agents_client(tmp_path):
    """Probes go through the client passed in; the supervisor leaves it open for its owner."""

    client = EngineClient()
    try:
        sup = _sup([_sim("a")], tmp_path / "a", client=client)
        try:
            await sup.start()
            _track(sup)
            (url,) = [e.url for e in sup.healthy()]
            await client.health(url, timeout=5)
            await client.health(url, timeout=5, generate=False)
        finally:
            await sup.stop()
        with pytest.raises(EngineUnavailable, match=r"/health_generate: ClientConnectorError"):
            await client.health(url, timeout=5)  # the engine is gone, the client is not
        sup = _sup([_sim("b")], tmp_path / "b", client=client)  # a second user of the same client
        try:
            await sup.start()
            _track(sup)
            assert sup.state("b") == "healthy"
        finally:
            await sup.stop()
    finally:
        await client.close()
    with pytest.raises(Closed):
        await client.health(url, timeout=5)


@pytest.mark.timeout(30)
async def test_client_health_reports_what_happened():
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", SIM_MODULE, "--host", "127.0.0.1", "--port", str(port), "--unhealthy"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    _SEEN_PIDS.add(proc.pid)

    try:
        client = EngineClient()
        try:
            await wait_for_async(lambda: _answers(client, url), 15, "the engine's port")
            with pytest.raises(EngineUnavailable, match=rf"HTTP 503 from {url}/health_generate"):
                await client.health(url, timeout=5)
            os.kill(proc.pid, signal.SIGSTOP)  # hung: the port is open but nothing answers
            with pytest.raises(EngineUnavailable, match=rf"no answer from {url}/health within 0.3s"):
                await client.health(url, timeout=0.3, generate=False)
        finally:
            await client.close()

    finally:
        proc.kill()
        proc.wait()


async def _answers(client: EngineClient, url: str) -> bool:
    """True once ``url`` answers /health_generate at all (an unhealthy answer counts)."""
    try:
        await client.health(url, timeout=1)
    except EngineUnavailable as e:
        return "HTTP" in str(e)
    return True


# ---------------------------------------------------------------- parallel layout and API keys


def _url_sim(*args: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", SIM_MODULE, "--host", "127.0.0.1", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    _SEEN_PIDS.add(proc.pid)
    return proc, f"http://127.0.0.1:{port}"


@pytest.mark.timeout(40)
async def test_url_and_sim_engines_take_their_tp_and_dp_from_server_info(tmp_path):
    """Red if: an engine given by URL counts as tp 1 whatever it runs (its weight-group ranks would collide)."""
    proc, url = _url_sim("--tp-size", "2", "--dp-size", "3")
    specs = plan_engines("url", urls=[url]) + [_sim("sim-4", "--tp-size", "4")]
    sup = _sup(specs, tmp_path, start_timeout=20.0)
    assert sup.tp("url-0") == 1 and sup.layout("url-0").from_server is False  # before it answered: as planned
    try:
        await sup.start()
        _track(sup)
        assert (sup.tp("url-0"), sup.dp("url-0")) == (2, 3)
        assert (sup.tp("sim-4"), sup.dp("sim-4")) == (4, 1)
        layout = sup.layout("url-0")
        assert layout.from_server and layout.quantization is None and not layout.enable_dp_attention
        assert sup.server_info("url-0")["tp_size"] == 2
    finally:
        await sup.stop()
        proc.kill()
        proc.wait()


@pytest.mark.timeout(40)
async def test_a_key_protected_url_engine_without_the_key_fails_start_naming_401_and_the_flag(tmp_path):
    """Red if: the agent takes a server it may not use for healthy (/health is open) and fails later, vaguely."""
    proc, url = _url_sim("--api-key", "k-123")
    try:
        sup = _sup(plan_engines("url", urls=[url]), tmp_path / "none")
        with pytest.raises(EngineStartError) as err:
            await sup.start()
        for part in ("url-0", "HTTP 401", "wants an API key", "--engine-api-key", "ROLLFLEET_ENGINE_API_KEY"):
            assert part in str(err.value), (part, str(err.value))
        assert sup.state("url-0") == "retired"
        sup = _sup(plan_engines("url", urls=[url]), tmp_path / "wrong", api_key="k-999")
        with pytest.raises(EngineStartError, match=r"HTTP 401.*refuses the key given.*--engine-api-key"):
            await sup.start()
        # With the key (the supervisor's own client sends it), the engine is healthy and its layout read.
        sup = _sup(plan_engines("url", urls=[url]), tmp_path / "key", api_key="k-123")
        try:
            await sup.start()
            assert sup.state("url-0") == "healthy" and sup.layout("url-0").from_server
        finally:
            await sup.stop()
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(40)
async def test_engines_launched_with_the_agents_key_refuse_callers_without_it(tmp_path):
    """Red if: --engine-api-key leaves the engines the agent launches open to anyone on the network."""
    sup = _sup(plan_engines("sim", api_key="k-launch"), tmp_path, api_key="k-launch")
    try:
        await sup.start()
        _track(sup)
        (url,) = [e.url for e in sup.healthy()]
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/model_info") as r:
                assert r.status == 401
            async with s.get(url + "/model_info", headers={"Authorization": "Bearer k-launch"}) as r:
                assert r.status == 200
        assert sup.layout("sim-0").from_server  # the supervisor's client sent the key
    finally:
        await sup.stop()
