"""Two `tokencache serve` replicas behind SGLang Model Gateway (smg, cache-aware policy), all on
127.0.0.1: the gateway takes them for SGLang workers, sends requests that share a system prompt
to the replica that cached it (read off each replica's /metrics), and serves the openai client,
streaming and not. One fleet for the module, started through `tokencache serve --replicas 2`
(the documented command); test_gateway_failover.py has its own."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
from gateway_helpers import (
    GATEWAY_ARGS,
    MODEL,
    REPLICA_ARGS,
    child_env,
    dump_logs,
    free_ports,
    metric_sum,
    metrics_text,
    require_smg,
)

from tokencache_serve.replicas import Fleet, get_json


class CliFleet:
    def __init__(self, proc: subprocess.Popen[bytes], gateway: str, replicas: list[str]) -> None:
        self.proc = proc
        self.gateway = gateway
        self.replicas = replicas


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CliFleet]:
    require_smg()
    log_dir = tmp_path_factory.mktemp("gateway")
    gw, base, _ = free_ports(3)  # replicas on base, base + 1; smg's metrics on base + 2
    cmd = [
        sys.executable,
        "-m",
        "tokencache_serve",
        "serve",
        *REPLICA_ARGS,
        "--port",
        str(gw),
        "--replicas",
        "2",
        "--replica-base-port",
        str(base),
        *(f"--gateway-arg={a}" for a in GATEWAY_ARGS),
    ]
    log = open(log_dir / "supervisor.log", "wb")  # noqa: SIM115  # closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env())
    f = CliFleet(proc, f"http://127.0.0.1:{gw}", [f"http://127.0.0.1:{base + k}" for k in (0, 1)])
    probe = Fleet([], [base, base + 1], None, f.gateway)
    try:
        deadline = time.monotonic() + 180
        while not probe.gateway_ready():
            assert proc.poll() is None, "tokencache serve --replicas exited"
            assert time.monotonic() < deadline, "the fleet did not start in 180 s"
            time.sleep(0.5)
        yield f
    except BaseException:
        log.flush()
        dump_logs(log_dir)
        raise
    finally:
        children = _children(proc.pid)
        proc.send_signal(signal.SIGTERM)  # the supervisor stops the gateway, then the replicas
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        for c in children:  # whatever it left behind
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                os.killpg(c.pid, signal.SIGKILL)
        log.close()
    assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)


def _children(pid: int) -> list[psutil.Process]:
    try:
        return list(psutil.Process(pid).children(recursive=True))
    except psutil.Error:
        return []


def client(f: CliFleet) -> Any:
    import openai

    # no client retries: only the gateway's
    return openai.OpenAI(base_url=f.gateway + "/v1", api_key="unused", max_retries=0, timeout=120)


def served_counts(f: CliFleet) -> list[tuple[float, float]]:
    """Per replica: (requests finished, prompt tokens its small model had cached at arrival)."""
    out = []
    for url in f.replicas:
        text = metrics_text(url)
        out.append(
            (
                metric_sum(text, "tokencache_requests_total"),
                metric_sum(text, "tokencache_prompt_tokens_cached_total", model="small"),
            )
        )
    return out


def words(seed: int, n: int) -> str:
    return " ".join(f"t{(seed * 7 + 3 * i) % 90}" for i in range(n))


def chat(f: CliFleet, system: str, user: str, max_tokens: int = 4) -> Any:
    return client(f).chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        max_tokens=max_tokens,
    )


def test_replicas_are_sglang_workers_to_the_gateway(fleet: CliFleet) -> None:
    workers = get_json(fleet.gateway + "/workers")["workers"]
    assert sorted(w["url"] for w in workers) == sorted(fleet.replicas)
    for w in workers:
        assert w["runtime_type"] == "sglang" and w["connection_mode"] == "http"
        assert w["is_healthy"] and w["model_id"] == MODEL
        assert w["models"][0]["context_length"] == 512  # from /server_info
    info = get_json(fleet.replicas[0] + "/server_info")
    assert info["dp_size"] == 1 and info["page_size"] == 1 and info["kv_events"] is None
    load = get_json(fleet.replicas[0] + "/v1/loads")["loads"][0]
    assert load["max_total_num_tokens"] == 8192 and 0 <= load["token_usage"] <= 1


def served_by(f: CliFleet, before: list[tuple[float, float]]) -> list[int]:
    after = served_counts(f)
    return [k for k in (0, 1) for _ in range(int(after[k][0] - before[k][0]))]


def test_requests_sharing_a_system_prompt_land_on_the_replica_that_cached_it(
    fleet: CliFleet,
) -> None:
    # Start two system prompts on different replicas: while a long request with prompt A (200
    # tokens, greedy) holds its replica, a miss should go to the idle one. Which replica a miss
    # goes to is smg's load balancing, not guaranteed: a few other B prompts are tried.
    sys_a, user_a = words(1, 80), "t5"
    sys_b = ""
    for attempt in range(5):
        before = served_counts(fleet)
        long_a = threading.Thread(target=chat, args=(fleet, sys_a, user_a, 200))
        long_a.start()
        deadline = time.monotonic() + 60
        while not any(
            get_json(u + "/v1/loads")["loads"][0]["num_running_reqs"] for u in fleet.replicas
        ):
            assert time.monotonic() < deadline and long_a.is_alive()
            time.sleep(0.02)
        candidate = words(2 + 3 * attempt, 80)
        chat(fleet, candidate, "t6")
        long_a.join(timeout=120)
        assert not long_a.is_alive()
        got = served_by(fleet, before)
        assert len(got) == 2
        if got[0] != got[1]:
            sys_b = candidate
            break
    assert sys_b, "smg never sent a miss to the idle replica"
    home = {"a": -1, "b": -1}
    for rnd in range(4):
        for name, system in (("a", sys_a), ("b", sys_b)):
            c0 = served_counts(fleet)
            r = chat(fleet, system, f"t{10 + rnd} t{20 + rnd}")
            assert r.choices[0].message.content
            c1 = served_counts(fleet)
            served = [k for k in (0, 1) if c1[k][0] > c0[k][0]]
            assert len(served) == 1
            k = served[0]
            if home[name] < 0:
                home[name] = k
            assert k == home[name], f"system prompt {name} moved from {home[name]} to {k}"
            # the replica had the whole system prompt cached (each word one token)
            assert c1[k][1] - c0[k][1] >= 80
    assert home["a"] != home["b"]


def test_openai_client_through_the_gateway(fleet: CliFleet) -> None:
    c = client(fleet)
    assert [m.id for m in c.models.list().data] == [MODEL]
    r = c.completions.create(model=MODEL, prompt="t1 t2 t3 t4", max_tokens=12)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
    text = "".join(
        ch.choices[0].text
        for ch in c.completions.create(
            model=MODEL, prompt="t1 t2 t3 t4", max_tokens=12, stream=True
        )
        if ch.choices
    )
    assert text == r.choices[0].text  # greedy, and both replicas hold the same weights
    chat_r = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "t7 t8"}], max_tokens=6
    )
    parts = [
        ch.choices[0].delta.content or ""
        for ch in c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "t7 t8"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        if ch.choices
    ]
    assert "".join(parts) == chat_r.choices[0].message.content
    extra = chat_r.choices[0].model_extra
    assert extra is not None and len(extra["tokencache"]["token_ids"]) == 6  # passed through


def test_replicas_get_every_option_but_the_fleets() -> None:
    from tokencache_serve.replicas import replica_command, strip_fleet_options

    argv = ["serve", "--large", "tiny", "--port", "9", "--replicas=2", "--gateway-arg=--x=1"]
    argv += ["--host", "0.0.0.0", "--kv-events-config", "{}", "--max-running", "4"]
    kept = strip_fleet_options(argv)
    assert kept == ["--large", "tiny", "--max-running", "4"]
    # replicas stay on loopback whatever --host the gateway binds
    assert replica_command(kept, 8001)[-4:] == ["--host", "127.0.0.1", "--port", "8001"]
