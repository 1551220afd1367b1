"""`tokencache serve --large-tp 2`: the server starts its large model's second rank (gloo on
127.0.0.1), answers as the unsharded server does, and leaves no process behind on SIGTERM.

The TP server runs in a subprocess (bounded in time: startup, the request, the shutdown); the
reference is the same command line without --large-tp, served in this process.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from serve_helpers import post_json

from tokencache_serve import DEFAULT_MODEL_NAME
from tokencache_serve.cli import build_app, build_parser
from tokencache_serve.runner import BackgroundServer

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["serve", "--large", "tiny", "--router", "entropy:3.4", "--max-running", "4"]
BODY = {"model": DEFAULT_MODEL_NAME, "prompt": [5, 6, 7, 8], "max_tokens": 24, "temperature": 0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def children(pid: int) -> list[int]:
    """Processes whose parent is pid (Linux /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (not reaped yet) is gone for our purpose
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except OSError:
        return False


def wait_health(url: str, proc: subprocess.Popen[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read() if proc.stderr else ""
            pytest.fail(f"the server exited ({proc.returncode}): {err[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    pytest.fail("the server did not become healthy in time")


def test_help_names_large_tp(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    help_text = capsys.readouterr().out
    assert "--large-tp N" in help_text and "gloo" in help_text
    assert build_parser().parse_args(["serve"]).large_tp == 1


def test_serve_large_tp2_answers_as_tp1() -> None:
    port = free_port()
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT / "integrations"),
        HF_HUB_OFFLINE="1",
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
    )
    cmd = [sys.executable, "-m", "tokencache_serve", *ARGS, "--large-tp", "2", "--port", str(port)]
    proc = subprocess.Popen(
        [*cmd, "--log-level", "warning", "--torch-threads", "1"],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    workers: list[int] = []
    try:
        url = f"http://127.0.0.1:{port}"
        wait_health(url, proc, 120)
        workers = children(proc.pid)
        assert workers, "no worker rank started"
        status, got = post_json(url, "/v1/completions", BODY)
        assert status == 200, got
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            pytest.fail("the server did not stop within 30 s of SIGTERM")
    deadline = time.monotonic() + 10
    while any(alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [w for w in workers if alive(w)]
    for w in left:
        os.kill(w, signal.SIGKILL)
    assert not left, "worker ranks outlived the server"

    app = build_app(build_parser().parse_args(ARGS))
    with BackgroundServer(app) as srv:
        status, want = post_json(srv.url, "/v1/completions", BODY)
    assert status == 200, want
    assert got["choices"][0]["text"] == want["choices"][0]["text"], (got, want)
    assert got["usage"] == want["usage"]
    assert want["usage"]["completion_tokens"] == 24


def _save(model: object, path: Path) -> None:
    """A checkpoint directory (config.json + model.safetensors) of a tokencache model."""
    import json

    from safetensors.torch import save_file

    cfg = model.config  # type: ignore[attr-defined]
    state = {k: v.contiguous() for k, v in model.state_dict().items()}  # type: ignore[attr-defined]
    path.mkdir()
    save_file(state, str(path / "model.safetensors"))
    keys = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
            "rope_theta", "tie_word_embeddings", "max_position_embeddings")  # fmt: skip
    (path / "config.json").write_text(json.dumps({**{k: getattr(cfg, k) for k in keys},
                                                  "dtype": "float32"}))  # fmt: skip


def test_checkpoint_large_is_read_by_slice(tmp_path: Path) -> None:
    """--large DIR --small DIR2 --large-tp 2: the large model is not loaded here; each rank
    reads its slices (a CheckpointShard of the directory)."""
    from tokencache_models.parallel.runtime import CheckpointShard
    from tokencache_serve.loading import load_models
    from tokencache_serve.tiny import tiny_pair, tiny_tokenizer

    small, large = tiny_pair()
    _save(small, tmp_path / "small")
    _save(large, tmp_path / "large")
    tiny_tokenizer().save_pretrained(str(tmp_path / "large"))
    m = load_models(str(tmp_path / "large"), str(tmp_path / "small"), large_tp=2)
    assert isinstance(m.large, CheckpointShard) and m.large.path == str(tmp_path / "large")
    assert "tensor-parallel over 2" in m.description
    whole = load_models(str(tmp_path / "large"), str(tmp_path / "small"))
    assert not isinstance(whole.large, CheckpointShard)
    assert m.tokenizer.encode("t3 t4") == whole.tokenizer.encode("t3 t4")
