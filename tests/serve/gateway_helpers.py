"""Replicas of `tokencache serve` (tiny models) behind SGLang Model Gateway, for the gateway tests
and the benchmark: loopback ports, bounded waits, every process stopped."""

from __future__ import annotations

import os
import socket
import sys
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import pytest

from tokencache_serve.replicas import Fleet, gateway_command, replica_command

MODEL = "tiny-routed"
# Tiny random models, greedy by default, one torch thread each: two replicas share two cores.
REPLICA_ARGS = (
    "--large",
    "tiny",
    "--router",
    "entropy:3.4",
    "--default-temperature",
    "0",
    "--served-model-name",
    MODEL,
    "--torch-threads",
    "1",
    "--tokenizer-threads",
    "1",
)
# smg's warm-up slice sends some cache hits to an idle worker on purpose (so a new worker
# fills its cache); off here, so that where a request lands is the policy's choice alone.
GATEWAY_ARGS = (
    "--worker-warmup-secs",
    "0",
    "--worker-warmup-divert-every",
    "0",
    "--log-level",
    "warn",
)


def require_smg() -> None:
    try:
        import smg  # noqa: F401
    except ImportError:  # loud: CI installs it (requirements/gateway.txt)
        pytest.fail("smg is not installed: pip install -r requirements/gateway.txt")


def free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    src = str(Path(__file__).resolve().parents[2] / "integrations")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return env


def make_fleet(
    n: int,
    log_dir: Path,
    policy: str = "cache_aware",
    replica_args: Sequence[str] = REPLICA_ARGS,
    gateway_args: Sequence[str] = GATEWAY_ARGS,
) -> Fleet:
    gw, prom, *ports = free_ports(n + 2)
    cmds = [replica_command(replica_args, p) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    gcmd = gateway_command("127.0.0.1", gw, urls, policy, prom, gateway_args)
    return Fleet(cmds, ports, gcmd, f"http://127.0.0.1:{gw}", log_dir=log_dir, env=child_env())


def metrics_text(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return str(r.read().decode())


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, rest = head.partition("{")
        if metric != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += float(value)
    return total


def dump_logs(log_dir: Path) -> None:
    """The children's logs on stderr (a failed test shows them)."""
    for f in sorted(log_dir.glob("*.log")):
        print(f"----- {f.name}", file=sys.stderr)
        print(f.read_text(errors="replace")[-4000:], file=sys.stderr)
