"""KV events published the way an SGLang 0.5.23 worker publishes them, so that a KV-aware
router that subscribes to SGLang's events subscribes to ours.

The wire format (sglang/srt/disaggregation/kv_events.py, ZmqEventPublisher): a ZeroMQ PUB socket
sends multipart messages (topic, 8-byte big-endian sequence number, msgpack payload); the
payload is a KVEventBatch, the positional array [ts, events, attn_dp_rank], whose events are
tagged maps (`type` = BlockStored / BlockRemoved / AllBlocksCleared, optional fields left at
None omitted). An optional ROUTER socket replays buffered batches from a sequence number (the
request: identity, empty frame, 8-byte start; each answer: identity, empty, topic, seq,
payload; then an end marker with seq -1). The configuration is SGLang's --kv-events-config
JSON ({"publisher": "zmq", "endpoint": ..., "replay_endpoint": ..., "topic": ..., "bind": ...}),
and /server_info describes the publisher under `kv_events` as SGLang does.

What is published: the small model's prefix cache (it prefills every prompt; the large model's
tree holds a lagging subset of the same sequences), read from the tree's own events
(RadixTree.take_events: SGLang's chained SHA-256 page hashes, as signed 64-bit ids) and grouped
exactly as SGLang's KVCacheEventRecorder groups them (one BlockStored per page, consecutive
pages of one chain merged; one BlockRemoved per node, consecutive removals merged).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    import tokencache

log = logging.getLogger("tokencache_serve")

MEDIUM_GPU = "GPU"  # SGLang's StorageMedium.GPU: the serving device's own KV pool (L1)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_WILDCARDS = ("*", "0.0.0.0", "::")


# The same structs as SGLang's (field names, order, tags and omit_defaults decide the bytes).
class EventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


@dataclass(frozen=True)
class KVEventsConfig:
    """SGLang's KVEventsConfig fields that a ZMQ publisher uses."""

    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    bind: bool | None = None  # None: bind a wildcard / ipc / inproc endpoint, else connect
    buffer_steps: int = 10_000
    hwm: int = 100_000

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-events-config is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = set(cls.__dataclass_fields__) | {"max_queue_size", "format"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"--kv-events-config: unknown keys {unknown}")
        if raw.get("format", "default") != "default":
            raise ValueError("--kv-events-config: only the default (SGLang) format is published")
        raw.pop("format", None)
        raw.pop("max_queue_size", None)
        cfg = cls(**raw)
        if cfg.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: unknown publisher {cfg.publisher!r}")
        return cfg

    def with_port_offset(self, k: int) -> KVEventsConfig:
        """Replica k's endpoints (SGLang offsets a DP rank's ports the same way)."""
        return KVEventsConfig(
            self.publisher,
            _offset(self.endpoint, k),
            None if self.replay_endpoint is None else _offset(self.replay_endpoint, k),
            self.topic,
            self.bind,
            self.buffer_steps,
            self.hwm,
        )

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in self.__dict__.items() if v is not None})

    def should_bind(self) -> bool:
        if self.bind is not None:
            return self.bind
        e = self.endpoint
        return any(w in e for w in _WILDCARDS) or e.startswith(("ipc://", "inproc://"))


def _offset(endpoint: str, k: int) -> str:
    if k == 0 or not endpoint.startswith("tcp://"):
        return endpoint
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + k}"


def _tcp_host_port(endpoint: str | None) -> tuple[str, int] | None:
    if not endpoint or not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) <= 65535:
        return None
    return host, int(port)


def describe(cfg: KVEventsConfig | None, block_size: int) -> dict[str, Any] | None:
    """/server_info's `kv_events` (sglang runtime_context.describe_kv_events_publisher):
    None when nothing is published on a TCP endpoint."""
    if cfg is None or cfg.publisher == "null":
        return None
    pub = _tcp_host_port(cfg.endpoint)
    if pub is None:
        return None
    out: dict[str, Any] = {
        "publisher": cfg.publisher,
        "endpoint_host": pub[0],
        "endpoint_port_base": pub[1],
        "topic": cfg.topic,
        "block_size": block_size,
        "dp_size": 1,
    }
    replay = _tcp_host_port(cfg.replay_endpoint)
    if replay is not None:
        out["replay_endpoint_port_base"] = replay[1]
    return out


# ------------------------------------------------------------------------------ conversion


class Grouper:
    """SGLang's KVCacheEventRecorder.enqueue: an event merges into the queue's tail when it
    continues it (a store whose parent is the tail's last block; a removal after a removal)."""

    def __init__(self) -> None:
        self.events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []

    def add(self, event: BlockStored | BlockRemoved | AllBlocksCleared) -> None:
        tail = self.events[-1] if self.events else None
        if isinstance(tail, BlockRemoved) and isinstance(event, BlockRemoved):
            if tail.medium == event.medium:
                tail.block_hashes.extend(event.block_hashes)
                return
        elif (
            isinstance(tail, BlockStored)
            and isinstance(event, BlockStored)
            and tail.medium == event.medium
            and tail.lora_id == event.lora_id
            and tail.block_size == event.block_size
            and tail.block_hashes
            and event.parent_block_hash == tail.block_hashes[-1]
        ):
            tail.block_hashes.extend(event.block_hashes)
            tail.token_ids.extend(event.token_ids)
            return
        self.events.append(event)


def convert(
    events: list[tokencache.KVEvent], page_size: int
) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
    """The tree's events as SGLang's recorder would queue them (no namespaces: the engine
    keeps none)."""
    g = Grouper()
    for e in events:
        if e.kind == "cleared":
            g.add(AllBlocksCleared())
        elif e.kind == "removed":
            g.add(BlockRemoved(block_hashes=list(e.page_hashes), medium=MEDIUM_GPU))
        else:
            parent = e.parent_hash
            tokens = list(e.token_ids)
            for i, h in enumerate(e.page_hashes):
                page = tokens[i * page_size : (i + 1) * page_size]
                g.add(
                    BlockStored(
                        block_hashes=[h],
                        parent_block_hash=parent,
                        token_ids=page,
                        block_size=len(page),
                        lora_id=None,
                        medium=MEDIUM_GPU,
                    )
                )
                parent = h
    return g.events


def enable_tree_events(engine: Any) -> tokencache.RadixTree:
    """The small model's tree, made to record events: an engine builds its trees without
    events, so a fresh one with the same settings replaces the (still empty) tree before the
    engine starts. (An engine option would be cleaner: see the serve README.)"""
    import tokencache

    side = engine.small
    old = side.tree
    if old.total_size() != 0:
        raise RuntimeError("KV events must be enabled before the engine caches anything")
    side.tree = tokencache.RadixTree(
        page_size=old.page_size, eviction_policy=old.eviction_policy, enable_events=True
    )
    tree: tokencache.RadixTree = side.tree
    return tree


# ------------------------------------------------------------------------------ publishing


class ZmqKVEventPublisher:
    """Drains a tree's events every `interval_s` in one thread (ZeroMQ sockets are used from
    that thread only), publishes each non-empty drain as one KVEventBatch and keeps the last
    `buffer_steps` batches for replay."""

    def __init__(
        self, tree: tokencache.RadixTree, cfg: KVEventsConfig, interval_s: float = 0.02
    ) -> None:
        import zmq

        self.tree = tree
        self.cfg = cfg
        self.interval_s = interval_s
        self.page_size = int(tree.page_size)
        ctx: Any = zmq.Context.instance()
        self._pub: Any = ctx.socket(zmq.PUB)
        self._pub.set_hwm(cfg.hwm)
        self._replay: Any = None
        try:
            if cfg.should_bind():
                self._pub.bind(cfg.endpoint)
            else:
                self._pub.connect(cfg.endpoint)
            if cfg.replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.bind(cfg.replay_endpoint)
        except zmq.ZMQError as e:
            self._close()
            raise ValueError(f"--kv-events-config: cannot open {cfg.endpoint}: {e}") from None
        self._topic = cfg.topic.encode()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self._stop = threading.Event()
        self.batches = 0  # published so far
        self._thread = threading.Thread(target=self._run, name="tokencache-kv-events", daemon=True)

    def start(self) -> None:
        self._thread.start()
        log.info("publishing KV events on %s (topic %r)", self.cfg.endpoint, self.cfg.topic)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._serve_replay()
                self.publish_pending()
            except Exception:  # a failed drain must not end publishing: logged, retried
                log.exception("KV event publishing failed")
            self._stop.wait(self.interval_s)
        self.publish_pending()  # what the engine cached last

    def publish_pending(self) -> None:
        events = convert(self.tree.take_events(), self.page_size)
        if not events:
            return
        payload = self._encoder.encode(KVEventBatch(ts=time.time(), events=events, attn_dp_rank=0))
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.batches += 1

    def _serve_replay(self) -> None:
        if self._replay is None:
            return
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in self._buffer:
                if seq >= first:
                    self._replay.send_multipart(
                        (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                    )
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._close()

    def _close(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
