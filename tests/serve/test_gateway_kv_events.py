"""KV events from `tokencache serve --kv-events-config`: byte for byte what SGLang's own recorder
and encoder make of the same tree events, decoded by SGLang's own decoder off the ZMQ socket,
replayed on request, and described in /server_info as SGLang describes its publisher."""

from __future__ import annotations

import json
import time
from typing import Any

import msgspec
import numpy as np
import pytest
from gateway_helpers import free_ports
from serve_helpers import MODEL, make_engine, post_json

import tokencache
from tokencache_serve import ServerConfig, create_app
from tokencache_serve.kv_events import KVEventBatch, KVEventsConfig, convert
from tokencache_serve.runner import BackgroundServer

zmq = pytest.importorskip("zmq")  # pyzmq comes with requirements/sglang.txt


@pytest.fixture(scope="module")
def sgl() -> Any:
    from tokencache_sglang.sglang_import import import_sglang

    import_sglang()  # the project's one way in (stubs torchvision on a CPU-only host)
    from sglang.srt.disaggregation import kv_events
    from sglang.srt.mem_cache.events import KVCacheEventRecorder

    from tokencache_sglang.events import replay

    return kv_events, KVCacheEventRecorder, replay


def tree_events(page_size: int) -> list[tokencache.KVEvent]:
    """Stores, a split, a branch, evictions and a reset: every kind of event."""
    t = tokencache.RadixTree(page_size=page_size, enable_events=True)
    slots = iter(range(10_000))

    def put(tokens: list[int]) -> None:
        t.insert(np.array(tokens), np.array([next(slots) for _ in tokens]))

    put(list(range(1, 13)))
    put([*range(1, 7), 50, 51, 52, 53])  # splits the first node after 6 tokens
    put([*range(1, 13), 60, 61])  # extends the first chain
    put([90, 91, 92, 93])
    t.evict(6)
    t.reset()
    put([7, 8])
    return t.take_events()


@pytest.mark.parametrize("page_size", [1, 2])
def test_our_batches_are_sglangs_bytes(sgl: Any, page_size: int) -> None:
    kv_events, recorder_cls, replay = sgl
    events = tree_events(page_size)
    recorder = recorder_cls(enabled=True, page_size=page_size)
    replay(recorder, events, page_size)  # SGLang's recorder fed the same tree events
    theirs = kv_events.KVEventBatch(ts=1.5, events=recorder.take(), attn_dp_rank=0)
    ours = KVEventBatch(ts=1.5, events=convert(events, page_size), attn_dp_rank=0)
    assert msgspec.msgpack.encode(ours) == msgspec.msgpack.encode(theirs)
    kinds = {type(e).__name__ for e in ours.events}
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}


def recv_batches(sock: Any, timeout_s: float) -> list[tuple[bytes, int, bytes]]:
    out = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sock.poll(100):
            topic, seq, payload = sock.recv_multipart()
            out.append((topic, int.from_bytes(seq, "big"), payload))
        elif out:
            break
    return out


def test_server_publishes_what_sglang_subscribers_decode(tiny: Any, sgl: Any) -> None:
    kv_events = sgl[0]
    pub, rep = free_ports(2)
    cfg = KVEventsConfig(
        endpoint=f"tcp://127.0.0.1:{pub}",
        replay_endpoint=f"tcp://127.0.0.1:{rep}",
        topic="kv",
        bind=True,
    )
    eng = make_engine(tiny)
    app = create_app(eng, tiny[2], ServerConfig(model_name=MODEL, kv_events=cfg))
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    dealer = ctx.socket(zmq.DEALER)
    try:
        with BackgroundServer(app) as srv:
            info = json.loads(json.dumps(_get(srv.url + "/server_info")))
            assert info["kv_events"] == {
                "publisher": "zmq",
                "endpoint_host": "127.0.0.1",
                "endpoint_port_base": pub,
                "topic": "kv",
                "block_size": 1,
                "dp_size": 1,
                "replay_endpoint_port_base": rep,
            }
            assert json.loads(info["kv_events_config"])["endpoint"] == cfg.endpoint
            sub.connect(cfg.endpoint)
            sub.setsockopt(zmq.SUBSCRIBE, b"kv")
            time.sleep(0.3)  # a SUB socket misses what is sent before it is connected
            prompt = list(range(10, 30))
            status, body = post_json(
                srv.url,
                "/v1/completions",
                {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0},
            )
            assert status == 200
            out = body["choices"][0]["tokencache"]["token_ids"]
            got = recv_batches(sub, 10)
            assert got and all(t == b"kv" for t, _, _ in got)
            seqs = [s for _, s, _ in got]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # consecutive
            decode = msgspec.msgpack.Decoder(kv_events.KVEventBatch)  # SGLang's own decoder
            batches = [decode.decode(p) for _, _, p in got]
            stored = [e for b in batches for e in b.events if type(e).__name__ == "BlockStored"]
            assert stored[0].parent_block_hash is None  # the prompt's chain starts at the root
            tokens = [t for e in stored for t in e.token_ids]
            # the prompt and what was generated (the last token is not cached: it has no KV yet)
            assert tokens[: len(prompt)] == prompt
            assert set(tokens[len(prompt) :]) <= set(out)
            assert all(e.block_size == 1 and e.medium == "GPU" for e in stored)
            hashes = [h for e in stored for h in e.block_hashes]
            assert len(set(hashes)) == len(hashes) == len(tokens)
            # replay from the first sequence number: the same batches, then the end marker
            dealer.connect(cfg.replay_endpoint)
            dealer.send_multipart((b"", seqs[0].to_bytes(8, "big")))
            replayed = []
            while dealer.poll(5000):
                frames = dealer.recv_multipart()
                if frames[2] == (-1).to_bytes(8, "big", signed=True):
                    break
                replayed.append((frames[1], int.from_bytes(frames[2], "big"), frames[3]))
            assert replayed[: len(got)] == got
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)


def _get(url: str) -> Any:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def test_config_parsing() -> None:
    cfg = KVEventsConfig.from_json('{"publisher": "zmq", "endpoint": "tcp://*:5557"}')
    assert cfg.should_bind() and cfg.with_port_offset(2).endpoint == "tcp://*:5559"
    assert not KVEventsConfig(endpoint="tcp://127.0.0.1:5557").should_bind()  # SGLang's rule
    for bad in ("[]", "{", '{"endpointt": "x"}', '{"format": "dynamo"}', '{"publisher": "x"}'):
        with pytest.raises(ValueError):
            KVEventsConfig.from_json(bad)
