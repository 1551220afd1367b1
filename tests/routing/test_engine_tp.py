"""EngineConfig(large_tp=2): the engine starts its large model's worker rank itself (gloo on
127.0.0.1), and stops it.

As in tests/models/test_tensor_parallel.py, each multi-process case runs in a driver subprocess
(this file as a script) bounded by a timeout, its worker a daemon of the driver:
- equal: greedy generations (Bernoulli escalations, batched catch-ups, a shared prefix) of a
  large_tp=2 engine equal, token for token and model for model, those of the same engine with
  the unsharded large model, in the event loop and in the threaded driver, with a configure
  hook (padded decode) on every rank; shutdown() ends the worker within seconds;
- kill: a worker killed during a generation ends every request (inside a catch-up, parked,
  running on the small model, waiting) with TPWorkerLost within seconds; a later submit is
  refused with it; shutdown() is quick and leaves no process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "integrations"))

from tokencache_models import CausalLM, ModelConfig, random_model  # noqa: E402

CFG = ModelConfig(
    model_type="qwen3",
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=True,
)


def models() -> tuple[CausalLM, CausalLM]:
    small = random_model(
        dataclasses.replace(CFG, num_hidden_layers=1),
        seed=3,
        std=0.3,
        attention_backend="torch",
    )
    large = random_model(CFG, seed=7, std=0.3, attention_backend="torch")
    return small, large


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    base = torch.randint(0, CFG.vocab_size, (9,), generator=g).tolist()
    return [
        base + torch.randint(0, CFG.vocab_size, (k % 7 + 1,), generator=g).tolist()
        for k in range(n)
    ]


class PadDecode:
    """configure: padded decode batches on every rank (the CUDA default; CPU here)."""

    def __call__(self, model: CausalLM) -> None:
        model.executor.decode_padding = True


def engine(
    small: CausalLM,
    large: CausalLM,
    mode: str,
    tp: int | None,
    router: Any = None,
    num_slots: int = 256,
) -> Any:
    from tokencache_routing import BernoulliRouter, EngineConfig, RoutedEngine, SchedulerConfig

    router = router or BernoulliRouter(0.3, seed=5)
    sched = SchedulerConfig(max_running=4, min_large_batch=2, max_wait_steps=2)
    kw: dict[str, Any] = {"large_tp": tp, "configure": PadDecode()} if tp else {}
    if not tp:
        large.executor.decode_padding = True
    small.executor.decode_padding = True
    return RoutedEngine(
        small,
        large,
        router,
        config=EngineConfig(num_slots=num_slots, scheduler=sched, mode=mode, **kw),
    )


def driver_equal() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in ("events", "threaded"):
        small, large = models()
        ref = engine(small, large, mode, None).generate(prompts(6), 10)
        small, large = models()
        eng = engine(small, large, mode, 2)
        procs = list(eng.large.model.tp.procs)
        res = eng.generate(prompts(6), 10)
        st = res.stats
        out[mode] = {
            "equal": res.tokens == ref.tokens and res.models == ref.models,
            "escalated": sum(map(sum, res.models)),
            "tokens": sum(map(len, res.models)),
            "catchups": list(st.catchup_batch_sizes),
            "padded_rank0": eng.large.model.executor.decode_padding,
            "idle": eng.idle_invariant(),
        }
        t0 = time.monotonic()
        eng.shutdown()
        out[mode]["shutdown_s"] = time.monotonic() - t0
        out[mode]["alive"] = [p.is_alive() for p in procs]
    return out


def driver_kill(mode: str, when: str) -> dict[str, Any]:
    """when "busy": killed while catch-ups keep coming (random escalations); "idle": every
    request escalates once, at its 3rd token, then decodes on the small model alone, so the
    group is idle when the worker dies and only the launcher's watchdog can end them."""
    from tokencache_models.parallel.runtime import TPWorkerLost
    from tokencache_routing import ScriptedRouter

    small, large = models()
    if when == "idle":
        eng = engine(small, large, mode, 2, ScriptedRouter(default=[2]), num_slots=4096)
    else:
        eng = engine(small, large, mode, 2)
    eng.start()  # a server's background driver
    procs = list(eng.large.model.tp.procs)
    max_new = 2000 if when == "idle" else 150
    handles = [eng.submit(q, max_new) for q in prompts(8)]
    deadline = time.monotonic() + 60
    while eng.stats.large_tokens < (8 if when == "idle" else 3):  # catch-ups ran
        assert time.monotonic() < deadline
        time.sleep(0.01)
    large_before = eng.stats.large_tokens
    os.kill(procs[0].pid, signal.SIGKILL)
    t0 = time.monotonic()
    ended = [h.wait(30) for h in handles]
    ended_s = time.monotonic() - t0
    refused = ""
    try:
        eng.submit([1, 2, 3], 4)
    except TPWorkerLost as e:
        refused = str(e)
    t1 = time.monotonic()
    eng.shutdown()
    return {
        "ended": ended,
        "ended_s": ended_s,
        "reasons": [h.finished_reason for h in handles],
        "errors": [f"{type(h.error).__name__}: {h.error}" for h in handles],
        "lengths": [len(h.tokens) for h in handles],
        "max_new": max_new,
        "large_after_kill": eng.stats.large_tokens - large_before,
        "refused": refused,
        "shutdown_s": time.monotonic() - t1,
        "alive": [p.is_alive() for p in procs],
    }


def run_driver(*args: str, timeout: float = 240) -> dict[str, Any]:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, __file__, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_large_tp2_equals_the_unsharded_engine() -> None:
    res = run_driver("equal")
    for mode in ("events", "threaded"):
        r = res[mode]
        assert r["equal"], (mode, r)
        assert 0 < r["escalated"] < r["tokens"], (mode, r)  # both models wrote tokens
        assert r["catchups"] and max(r["catchups"]) >= 2, (mode, r)  # batched catch-ups
        assert r["padded_rank0"] and r["idle"], (mode, r)
        assert r["shutdown_s"] < 10 and not any(r["alive"]), (mode, r)


@pytest.mark.parametrize("mode,when", [("events", "busy"), ("threaded", "busy"),
                                       ("events", "idle")])  # fmt: skip
def test_dead_worker_ends_every_request(mode: str, when: str) -> None:
    res = run_driver("kill", mode, when, timeout=180)
    assert all(res["ended"]) and res["ended_s"] < 5.0, res
    assert all(why == "error" for why in res["reasons"]), res
    assert all("TPWorkerLost" in e and "tensor-parallel" in e for e in res["errors"]), res
    assert all(n < res["max_new"] for n in res["lengths"]), res  # ended by the loss
    if when == "idle":  # no large forward failed: the watchdog ended them
        assert res["large_after_kill"] == 0, res
    assert "tensor-parallel" in res["refused"], res
    assert res["shutdown_s"] < 5.0 and not any(res["alive"]), res


def test_refuses_what_cannot_run() -> None:
    from tokencache_routing import BernoulliRouter, EngineConfig, RoutedEngine

    small, large = models()
    router = BernoulliRouter(0.1)
    with pytest.raises(ValueError, match="large_tp must be a positive int"):
        RoutedEngine(small, large, router, config=EngineConfig(num_slots=64, large_tp=0))
    with pytest.raises(ValueError, match="large_tp_devices"):
        RoutedEngine(
            small, large, router, config=EngineConfig(num_slots=64, large_tp=2, large_device="cpu")
        )
    with pytest.raises(ValueError, match="needs 2 devices"):
        RoutedEngine(
            small,
            large,
            router,
            config=EngineConfig(num_slots=64, large_tp=2, large_tp_devices=["cpu"]),
        )
    with pytest.raises(ValueError, match="go with large_tp"):
        RoutedEngine(small, large, router, config=EngineConfig(num_slots=64, configure=PadDecode()))
    # large_tp=1: no group, the model as it is
    eng = RoutedEngine(small, large, router, config=EngineConfig(num_slots=64, large_tp=1))
    assert eng.large.model.tp is None and eng._large_tp is None
    eng.shutdown()


def test_default_devices_leave_cuda0_to_the_small_model(monkeypatch: pytest.MonkeyPatch) -> None:
    from tokencache_routing.tp_launch import default_devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_devices(2) == ["cpu", "cpu"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert default_devices(2) == ["cuda:1", "cuda:2"]  # the small model keeps cuda:0
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert default_devices(2) == ["cuda:0", "cuda:1"]  # only 2: the small model shares cuda:0
    with pytest.raises(ValueError, match="needs 4 CUDA devices"):
        default_devices(4)


if __name__ == "__main__":
    torch.set_num_threads(1)
    result = driver_equal() if sys.argv[1] == "equal" else driver_kill(sys.argv[2], sys.argv[3])
    print(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)
