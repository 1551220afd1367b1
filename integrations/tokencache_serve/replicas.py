"""Several `tokencache serve` replicas behind SGLang Model Gateway (smg) on one machine.

    tokencache serve --replicas 2 [--gateway-policy cache_aware] [serve options ...]

starts replica k as `python -m tokencache_serve serve <the same options> --host 127.0.0.1
--port <base + k>` (base: --replica-base-port, default --port + 1), waits until each answers
/health, then starts `python -m smg launch` on --host/--port with the replicas as its HTTP
workers and the chosen policy. smg probes each worker (/health, /v1/models, /server_info,
/v1/loads, /metrics), identifies it as an SGLang-protocol worker and routes OpenAI requests to
it. Ctrl-C (or SIGTERM) stops the gateway, then the replicas (each drains as a lone server does).
A replica that dies is left dead (the gateway routes around it); if the gateway dies, all stop.

Fleet is the same machinery for tests and the benchmark (any worker command).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Any

log = logging.getLogger("tokencache_serve")

# serve options the supervisor consumes; a replica gets everything else
_FLEET_VALUED = (
    "--replicas",
    "--replica-base-port",
    "--gateway-policy",
    "--gateway-arg",
    "--port",
    "--host",
    "--kv-events-config",
)


def strip_fleet_options(argv: Sequence[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _FLEET_VALUED:
            skip = "=" not in arg
            continue
        out.append(arg)
    if out and out[0] == "serve":
        out = out[1:]
    return out


def replica_command(serve_args: Sequence[str], port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tokencache_serve",
        "serve",
        *serve_args,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]


def gateway_command(
    host: str,
    port: int,
    worker_urls: Sequence[str],
    policy: str = "cache_aware",
    prometheus_port: int | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """`smg launch` with its network defaults overridden: it binds 0.0.0.0 (router and
    metrics) and may fetch a tokenizer from the Hugging Face hub unless told otherwise."""
    cmd = [
        sys.executable,
        "-m",
        "smg",
        "launch",
        "--host",
        host,
        "--port",
        str(port),
        "--worker-urls",
        *worker_urls,
        "--policy",
        policy,
        "--prometheus-host",
        "127.0.0.1",
        "--disable-tokenizer-autoload",
    ]
    if prometheus_port is not None:
        cmd += ["--prometheus-port", str(prometheus_port)]
    return [*cmd, *extra]


def _request(url: str, api_key: str | None) -> urllib.request.Request:
    req = urllib.request.Request(url)
    if api_key is not None:
        req.add_header("Authorization", f"Bearer {api_key}")
    return req


def get_json(url: str, timeout: float = 5.0, api_key: str | None = None) -> Any:
    with urllib.request.urlopen(_request(url, api_key), timeout=timeout) as r:
        return json.loads(r.read())


def _alive(url: str, api_key: str | None = None) -> bool:
    try:
        with urllib.request.urlopen(_request(url, api_key), timeout=2) as r:
            return bool(r.status == 200)
    except (OSError, urllib.error.URLError):
        return False


class Fleet:
    """Replica processes and the gateway, started in order and always stopped (context
    manager). Children run in their own sessions (the supervisor decides when they stop) and
    get SIGTERM if the thread that started them dies: start() from a thread that outlives
    the fleet (the main thread)."""

    def __init__(
        self,
        replica_cmds: Sequence[Sequence[str]],
        replica_ports: Sequence[int],
        gateway_cmd: Sequence[str] | None,
        gateway_url: str | None,
        log_dir: Path | None = None,
        env: dict[str, str] | None = None,
        api_key: str | None = None,
    ) -> None:
        self.replica_cmds = [list(c) for c in replica_cmds]
        self.replica_urls = [f"http://127.0.0.1:{p}" for p in replica_ports]
        self.gateway_cmd = None if gateway_cmd is None else list(gateway_cmd)
        self.gateway_url = gateway_url
        self.log_dir = log_dir
        self.env = env
        self.api_key = api_key  # smg given --api-key requires it on every route, /workers too
        self.replicas: list[subprocess.Popen[bytes]] = []
        self.gateway: subprocess.Popen[bytes] | None = None
        self._logs: list[IO[bytes]] = []

    def _spawn(self, cmd: list[str], name: str) -> subprocess.Popen[bytes]:
        out: IO[bytes] | None = None
        if self.log_dir is not None:
            out = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115  # closed in stop()
            self._logs.append(out)
        return subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT if out is not None else None,
            env=self.env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )

    def start(self, timeout_s: float = 120.0) -> Fleet:
        deadline = time.monotonic() + timeout_s
        try:
            for k, cmd in enumerate(self.replica_cmds):
                self.replicas.append(self._spawn(cmd, f"replica{k}"))
            for k, url in enumerate(self.replica_urls):
                self._wait(lambda u=url: _alive(u + "/health"), self.replicas[k], deadline, url)
            if self.gateway_cmd is not None:
                self.gateway = self._spawn(self.gateway_cmd, "gateway")
                self._wait(self.gateway_ready, self.gateway, deadline, "the gateway")
        except BaseException:
            self.stop()
            raise
        return self

    def _wait(self, ready: Any, proc: subprocess.Popen[bytes], deadline: float, what: str) -> None:
        while not ready():
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {proc.returncode} before it was ready")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not ready in time")
            time.sleep(0.2)

    def gateway_workers(self) -> list[dict[str, Any]]:
        """The gateway's worker list (GET /workers), [] while it does not answer."""
        assert self.gateway_url is not None
        try:
            body = get_json(self.gateway_url + "/workers", api_key=self.api_key)
        except (OSError, urllib.error.URLError, ValueError):
            return []
        workers = body.get("workers", []) if isinstance(body, dict) else body
        return list(workers) if isinstance(workers, list) else []

    def gateway_ready(self) -> bool:
        """Every replica registered and healthy at the gateway, which serves /v1/models."""
        assert self.gateway_url is not None
        healthy = [w for w in self.gateway_workers() if w.get("is_healthy", True)]
        models = _alive(self.gateway_url + "/v1/models", self.api_key)
        return len(healthy) >= len(self.replica_urls) and models

    def kill_replica(self, k: int) -> None:
        """SIGKILL (a crash: no drain)."""
        p = self.replicas[k]
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)

    def stop(self, grace_s: float = 10.0) -> None:
        procs = ([self.gateway] if self.gateway is not None else []) + self.replicas
        for p in procs:  # the gateway first: no new requests reach a stopping replica
            _terminate(p, grace_s)
        for f in self._logs:
            f.close()
        self._logs = []

    def __enter__(self) -> Fleet:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the thread that started it dies (Linux
    PR_SET_PDEATHSIG), so a supervisor killed outright (SIGKILL, a CI timeout) leaves no
    replica or gateway behind. Elsewhere a no-op."""
    if sys.platform != "linux":
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def _terminate(p: subprocess.Popen[bytes], grace_s: float) -> None:
    if p.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGTERM)
    try:
        p.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=10)


def serve_fleet(a: argparse.Namespace, argv: Sequence[str]) -> None:
    """`tokencache serve --replicas N`: runs until Ctrl-C / SIGTERM or the gateway exits."""
    import importlib.util

    from tokencache_extras import install_hint

    if importlib.util.find_spec("smg") is None:  # the gateway extra (tokencache_extras has
        # no "gateway" entry yet: another owner's file)
        raise ValueError(
            f"--replicas runs SGLang Model Gateway (smg), which is not installed; it comes "
            f'with the "gateway" extra: {install_hint("gateway")}'
        )
    from .kv_events import KVEventsConfig

    n = a.replicas
    if n < 1:
        raise ValueError("--replicas must be >= 1")
    base = a.replica_base_port if a.replica_base_port is not None else a.port + 1
    ports = [base + k for k in range(n)]
    if a.port in ports:
        raise ValueError("--replica-base-port: the replicas' ports include the gateway's")
    serve_args = strip_fleet_options(argv)
    kv = None if a.kv_events_config is None else KVEventsConfig.from_json(a.kv_events_config)
    cmds = []
    for k, p in enumerate(ports):
        extra = [] if kv is None else ["--kv-events-config", kv.with_port_offset(k).to_json()]
        cmds.append([*replica_command(serve_args, p), *extra])
    from .apikey import api_key

    # The replicas require it on /v1 (smg's probes of /v1/models too); smg given --api-key
    # sends it to the workers and requires it from its own clients.
    key = api_key(a)
    gw = gateway_command(
        a.host, a.port, [f"http://127.0.0.1:{p}" for p in ports], a.gateway_policy,
        prometheus_port=base + n,
        extra=[*(["--api-key", key] if key else []), *a.gateway_arg],
    )  # fmt: skip
    fleet = Fleet(cmds, ports, gw, f"http://{_url_host(a.host)}:{a.port}", api_key=key)

    def stop_signal(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop_signal)
    log.info("starting %d replicas on ports %s, then the gateway on port %d", n, ports, a.port)
    try:
        with fleet:  # leaving it stops the gateway, then the replicas
            fleet.start(timeout_s=3600)  # real models may load for minutes
            log.info("gateway (policy %s) serving on %s", a.gateway_policy, fleet.gateway_url)
            while fleet.gateway is not None and fleet.gateway.poll() is None:
                for k, p in enumerate(fleet.replicas):
                    if p.returncode is None and p.poll() is not None:
                        log.warning("replica %d exited with %d", k, p.returncode)
                time.sleep(0.5)
            log.error("the gateway exited; stopping the replicas")
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM, also while starting
        log.info("stopped the gateway and the replicas")


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host
