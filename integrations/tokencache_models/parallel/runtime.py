"""Tensor-parallel runtime: the engine's rank drives, worker ranks run the same forwards.

The engine's process is rank 0: its model shard carries a TPDriver (`model.tp`), its radix tree,
cursors and slot table stay there (slot ids mean the same on every rank). Each forward's
compact metadata (the HostBatch's O(batch + new tokens) arrays, and for a slot-table forward the
table entries written since the last one) goes to the workers over a gloo group of its own
(host arrays, and an order independent of the forward's collectives), when the engine runs the
step (ModelExecutor.execute); the workers rebuild the HostBatch over their mirror of the slot
table and run the same prepare / execute on their shard, meeting rank 0 in its all-reduces.

A worker that dies ends the engine's next (or current) forward with TPWorkerLost within
the group's timeout (gloo notices a closed peer at once); a worker whose engine dies exits.

Start: `launch(ShardOf(factory), world)` spawns the workers from the engine's process; with
torchrun, rank 0 calls `init_tp()` + `attach_driver(...)` and the others `serve_worker(...)`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..forward.context import HostBatch
from ..kv.pool import KVPool
from ..kv.slot_table import SlotTable
from ..model import CausalLM
from ..shared_prefix.groups import PrefixGroup
from .sharding import load_hf_checkpoint_shard, shard_model
from .tp_layers import TPGroup

OP_FORWARD, OP_POOL, OP_STOP, OP_DROP_POOL, OP_DROP_TABLE = 1, 2, 3, 4, 5
HEADER = 16
BACKENDS = ("torch", "triton")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEFAULT_TIMEOUT_S = 60.0
# A worker waits this long for its engine's next forward (an idle server sends none; a dead
# engine closes the connection, which gloo reports at once).
WORKER_IDLE_S = 7 * 24 * 3600.0


class TPWorkerLost(RuntimeError):
    """A tensor-parallel worker rank died or stopped answering: the model is unusable."""


# -- slot tables -----------------------------------------------------------------------------


class TPSlotTable(SlotTable):
    """The engine's slot table of a tensor-parallel model: also keeps every write for the
    workers' mirrors (on any device), until the next forward takes them."""

    _next_id = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.tp_writes: list[tuple[np.ndarray, np.ndarray]] = []
        super().__init__(*args, **kwargs)
        self.tp_id = TPSlotTable._next_id
        TPSlotTable._next_id += 1
        self.tp_sent_generation = -1  # the storage generation the workers hold
        self.tp_unsent = False  # a prepared forward took writes it has not sent yet

    def _allocate(self, rows: int, width: int) -> None:
        super()._allocate(rows, width)
        self.tp_writes = []  # the whole table, sent with the next forward, carries them

    def write(self, row: int, start: int, slots: np.ndarray) -> None:
        super().write(row, start, slots)  # may grow the table first: flat indices after
        n = len(slots)
        if n:
            flat = row * self.width + start + np.arange(n, dtype=np.int64)
            self.tp_writes.append((flat, np.asarray(slots, np.int64).copy()))

    def scatter(self, rows: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> None:
        super().scatter(rows, positions, slots)
        if len(slots):
            flat = np.asarray(rows, np.int64) * self.width + np.asarray(positions, np.int64)
            self.tp_writes.append((flat, np.asarray(slots, np.int64).copy()))


class MirrorTable(SlotTable):
    """A worker's copy of the engine's slot table: loaded whole when the engine's storage moved,
    patched with the engine's writes before each forward. Its prefix groups come from the
    engine (HostBatch.memo), never from facts of its own."""

    def __init__(self, scratch_slot: int, device: torch.device) -> None:
        super().__init__(1, 1, scratch_slot, device)

    def load(self, host: np.ndarray, generation: int) -> None:
        self.host = host
        self.flat_host = host.reshape(-1)
        if self.device.type == "cpu":
            self.table = torch.from_numpy(host)
        else:
            self.table = torch.from_numpy(host).to(self.device)
        self._pending.clear()
        self.flat = self.table.view(-1)
        self._held = np.zeros(host.shape[0] - 1, dtype=bool)  # rows: what starts() assume
        self.generation = generation

    def apply(self, flat: np.ndarray, slots: np.ndarray) -> None:
        self.flat_host[flat] = slots
        if self.device.type != "cpu":
            self._pending.append((flat, slots))  # applied by the forward's one copy

    def prefix_groups(self, *args: Any, **kwargs: Any) -> list[PrefixGroup]:
        raise RuntimeError("a mirror table's prefix groups come from the engine's rank")


def make_slot_table(
    model: CausalLM, rows: int, width: int, pool: KVPool, max_width: int | None = None
) -> SlotTable:
    """The slot table an engine keeps for `model`: a TPSlotTable when it drives workers."""
    cls = TPSlotTable if isinstance(model.tp, TPDriver) else SlotTable
    return cls(rows, width, pool.scratch_slot, pool.device, max_width=max_width)


# -- the forward's metadata ------------------------------------------------------------------


@dataclass
class Payload:
    header: np.ndarray  # [HEADER] int64
    body: np.ndarray  # int64
    table: TPSlotTable | None = None


def _encode_groups(groups: Sequence[PrefixGroup]) -> np.ndarray:
    out = [len(groups)]
    for g in groups:
        out += [g.length, len(g.rows), *g.rows]
    return np.asarray(out, np.int64)


def _decode_groups(enc: np.ndarray) -> list[PrefixGroup]:
    vals = enc.tolist()
    groups, at = [], 1
    for _ in range(vals[0]):
        length, k = vals[at], vals[at + 1]
        groups.append(PrefixGroup(tuple(vals[at + 2 : at + 2 + k]), length))
        at += 2 + k
    return groups


def encode_forward(hb: HostBatch, pool_id: int, backend: str, seq: int) -> Payload:
    """The worker's copy of a forward: O(batch + new tokens), plus the slot table's writes since
    the last forward (the whole table only when its storage moved)."""
    if hb.deferred is not None:  # ModelExecutor.prepare refuses them first; no room on the wire
        raise ValueError("DeferredTokens are not supported on a tensor-parallel model")
    header = np.zeros(HEADER, np.int64)
    t, b = len(hb.token_ids), hb.num_requests
    parts = [hb.token_ids, hb.positions, hb.out_slots, hb.q_offsets, hb.kv_starts, hb.kv_lens]
    header[:6] = (OP_FORWARD, pool_id, BACKENDS.index(backend), hb.num_real, b, t)
    table: TPSlotTable | None = None
    if hb.table is None:
        header[6] = len(hb.kv_slots)
        parts.append(hb.kv_slots)
    else:
        if not isinstance(hb.table, TPSlotTable):
            raise TypeError(
                "a tensor-parallel model's slot table must be a TPSlotTable (make_slot_table)"
            )
        table = hb.table
        assert hb.rows is not None
        header[6] = -1
        parts.append(hb.rows[: hb.num_real])
        header[8], header[9], header[15] = table.width, table.generation, table.tp_id
        if table.tp_unsent or table.tp_sent_generation != table.generation:
            header[7] = table.host.shape[0]
            parts.append(table.flat_host.copy())
            table.tp_writes = []
        elif table.tp_writes:
            flat = np.concatenate([w[0] for w in table.tp_writes])
            vals = np.concatenate([w[1] for w in table.tp_writes])
            table.tp_writes = []
            header[10] = len(flat)
            parts += [flat, vals]
        table.tp_sent_generation = table.generation
        table.tp_unsent = True  # until executing() sends it: else the next one sends all
    groups = hb.memo.get("groups")
    header[11] = -1
    if groups is not None:
        enc = _encode_groups(groups)
        header[11] = len(enc)
        parts.append(enc)
    header[13] = seq
    body = np.concatenate([np.asarray(p, np.int64).reshape(-1) for p in parts])
    header[12] = len(body)
    return Payload(header, body, table)


def decode_forward(
    header: np.ndarray, body: np.ndarray, tables: dict[int, MirrorTable], pool: KVPool
) -> HostBatch:
    """The HostBatch a worker runs (over its mirror of the engine's slot table)."""
    _, _, _, num_real, b, t = (int(x) for x in header[:6])
    at = 0

    def take(n: int) -> np.ndarray:
        nonlocal at
        out = body[at : at + n]
        at += n
        return out

    token_ids, positions, out_slots = take(t), take(t), take(t)
    q_offsets, kv_starts, kv_lens = take(b + 1), take(b), take(b)
    table: MirrorTable | None = None
    rows = None
    if header[6] >= 0:
        kv_slots = take(int(header[6]))
    else:
        rows = take(num_real)
        tid = int(header[15])
        table = tables.get(tid)
        if table is None:
            table = tables[tid] = MirrorTable(pool.scratch_slot, pool.device)
        if header[7] > 0:
            n_rows, width = int(header[7]), int(header[8])
            table.load(take(n_rows * width).reshape(n_rows, width).copy(), int(header[9]))
        elif header[10] > 0:
            n = int(header[10])
            table.apply(take(n).copy(), take(n).copy())
        if table.generation != int(header[9]) or table.width != int(header[8]):
            raise RuntimeError("worker slot table out of step with the engine's")
        kv_slots = table.flat_host
    hb = HostBatch(
        token_ids=token_ids,
        positions=positions,
        out_slots=out_slots,
        q_offsets=q_offsets,
        kv_slots=kv_slots,
        kv_starts=kv_starts,
        kv_lens=kv_lens,
        num_real=num_real,
        table=table,
        rows=rows,
    )
    # The engine's groups, or none when it looked for none (its backend reads no shared
    # prefix): a worker never searches on its own, so both compute the same attention.
    hb.memo["groups"] = _decode_groups(take(int(header[11]))) if header[11] >= 0 else []
    return hb


# -- the engine's rank -----------------------------------------------------------------------


@dataclass
class TPDriver:
    """model.tp on the engine's rank (CausalLM's TPHooks): mirrors pools and forwards."""

    tp: TPGroup
    meta: Any  # the gloo group of the metadata broadcasts
    procs: list[BaseProcess] = field(default_factory=list)  # workers it spawned (launch)
    timeout_s: float = DEFAULT_TIMEOUT_S
    # pool -> its id on every rank (weak: a pool dropped here is dropped on the workers)
    pools: weakref.WeakKeyDictionary[KVPool, int] = field(default_factory=weakref.WeakKeyDictionary)
    next_pool: int = 0
    tables: set[int] = field(default_factory=set)  # TPSlotTable ids the workers mirror
    # (op, id) of pools and tables garbage-collected here, dropped on the workers with the
    # next message (finalizers only append: no collective runs inside one)
    dropped: list[tuple[int, int]] = field(default_factory=list)
    seq: int = 0
    lost: str | None = None  # why the group is unusable
    # Called once (from the watchdog thread or the failing forward's) when the group is lost,
    # not when it is shut down: an engine ends its requests there (tokencache_routing).
    on_lost: Callable[[str], None] | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _told: bool = False

    def _lose(self, why: str) -> None:
        self.lost = why
        if self._told or self._stop.is_set() or self.on_lost is None:
            return
        self._told = True
        try:
            self.on_lost(why)
        except Exception:  # the caller's error must stay TPWorkerLost
            traceback.print_exc()

    def watch(self, interval_s: float = 0.2) -> None:
        """Starts a daemon thread that notices a launched worker's death between forwards and,
        on NCCL, aborts the process group: a forward waiting on the device in a collective
        then fails instead of spinning until the NCCL timeout (gloo sees the closed peer
        itself). The abort path has not run on a GPU yet."""

        def loop() -> None:
            while not self._stop.wait(interval_s):
                dead = [r for r, p in enumerate(self.procs, 1) if p.exitcode is not None]
                if dead and not self._stop.is_set():
                    code = self.procs[dead[0] - 1].exitcode
                    why = f"tensor-parallel worker rank {dead[0]} exited (code {code})"
                    self.lost = why
                    if dist.is_initialized() and dist.get_backend() == "nccl":
                        from torch.distributed.distributed_c10d import _abort_process_group

                        _abort_process_group()
                    self._lose(why)
                    return

        if self.procs:
            threading.Thread(target=loop, name="tp-watchdog", daemon=True).start()

    def _check(self) -> None:
        if self.lost is not None:
            raise TPWorkerLost(self.lost)
        for rank, p in enumerate(self.procs, start=1):
            if p.exitcode is not None:
                self._lose(f"tensor-parallel worker rank {rank} exited (code {p.exitcode})")
                raise TPWorkerLost(self.lost)

    def fail(self, exc: BaseException) -> TPWorkerLost:
        """The error a failed collective becomes (the workers are gone or out of step)."""
        deadline = time.monotonic() + 2.0  # a killed worker's exit code shows up shortly
        while self.procs and time.monotonic() < deadline:
            if any(p.exitcode is not None for p in self.procs):
                break
            time.sleep(0.05)
        dead = [
            f"rank {r} (code {p.exitcode})"
            for r, p in enumerate(self.procs, 1)
            if p.exitcode is not None
        ]
        why = f"dead worker {', '.join(dead)}" if dead else "a worker stopped answering"
        self._lose(f"tensor-parallel group lost: {why}: {type(exc).__name__}: {exc}")
        return TPWorkerLost(self.lost)

    def _send(self, header: np.ndarray, body: np.ndarray | None) -> None:
        self._check()
        try:
            while self.dropped:
                op, what = self.dropped.pop()
                drop = np.zeros(HEADER, np.int64)
                drop[:2] = (op, what)
                dist.broadcast(torch.from_numpy(drop), src=0, group=self.meta)
            dist.broadcast(torch.from_numpy(header), src=0, group=self.meta)
            if body is not None and len(body):
                dist.broadcast(torch.from_numpy(body), src=0, group=self.meta)
        except Exception as exc:
            raise self.fail(exc) from exc

    def pool_made(self, pool: KVPool) -> None:
        pid = self.next_pool
        self.next_pool += 1
        self.pools[pool] = pid
        weakref.finalize(pool, self.dropped.append, (OP_DROP_POOL, pid))
        header = np.zeros(HEADER, np.int64)
        header[:6] = (OP_POOL, pid, 0, 0, pool.num_slots, DTYPES.index(pool.dtype))
        self._send(header, None)

    def prepared(self, hb: HostBatch, pool: KVPool, backend: str) -> Payload:
        self._check()
        pid = self.pools.get(pool)
        if pid is None:
            raise ValueError("the pool was not made by this tensor-parallel model (make_kv_pool)")
        table = hb.table
        if isinstance(table, TPSlotTable) and table.tp_id not in self.tables:
            self.tables.add(table.tp_id)
            weakref.finalize(table, self.dropped.append, (OP_DROP_TABLE, table.tp_id))
        self.seq += 1
        return encode_forward(hb, pid, backend, self.seq)

    def executing(self, payload: Any) -> None:
        assert isinstance(payload, Payload)
        self._send(payload.header, payload.body)
        if payload.table is not None:
            payload.table.tp_unsent = False

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stops the workers (joined, killed past timeout_s) and leaves the process group."""
        self._stop.set()  # their exits from here on are expected
        if self.lost is None:
            header = np.zeros(HEADER, np.int64)
            header[0] = OP_STOP
            with contextlib.suppress(TPWorkerLost):
                self._send(header, None)
        self.lost = self.lost or "tensor-parallel group shut down"
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                p.kill()
                p.join(5.0)
        if dist.is_initialized():
            dist.destroy_process_group()


def attach_driver(
    model: CausalLM,
    meta: Any,
    procs: Sequence[BaseProcess] = (),
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> CausalLM:
    """Makes rank 0's shard drive the workers (model.tp)."""
    assert model.tp_group is not None and model.tp_group.rank == 0
    driver = TPDriver(model.tp_group, meta, list(procs), timeout_s)
    driver.watch()
    model.tp = driver
    return model


# -- worker ranks ----------------------------------------------------------------------------


def serve_worker(model: CausalLM, meta: Any) -> None:
    """A worker's loop: pools and forwards as the engine's rank sends them, until told to stop.
    Any failure ends the process (its peers then see a closed connection, not a hang)."""
    pools: dict[int, KVPool] = {}
    tables: dict[int, MirrorTable] = {}
    header = torch.zeros(HEADER, dtype=torch.int64)
    while True:
        dist.broadcast(header, src=0, group=meta)
        h = header.numpy().copy()
        op = int(h[0])
        if op == OP_STOP:
            return
        if op == OP_POOL:
            pools[int(h[1])] = model.make_kv_pool(int(h[4]), DTYPES[int(h[5])])
            continue
        if op == OP_DROP_POOL:
            pools.pop(int(h[1]), None)
            continue
        if op == OP_DROP_TABLE:
            tables.pop(int(h[1]), None)
            continue
        if op != OP_FORWARD:
            raise RuntimeError(f"unknown tensor-parallel op {op}")
        body = torch.empty(int(h[12]), dtype=torch.int64)
        if body.numel():
            dist.broadcast(body, src=0, group=meta)
        pool = pools[int(h[1])]
        hb = decode_forward(h, body.numpy(), tables, pool)
        executor = model.executor
        executor.execute(executor.prepare(hb, pool, BACKENDS[int(h[2])]))


# -- starting the group ----------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def init_tp(
    rank: int,
    world: int,
    port: int,
    addr: str = "127.0.0.1",
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> tuple[TPGroup, Any]:
    """Joins the group (the default process group: NCCL on CUDA, gloo otherwise) and a gloo
    group for the metadata. Returns (TPGroup, metadata group)."""
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if addr in ("127.0.0.1", "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    dist.init_process_group(
        backend,
        init_method=f"tcp://{addr}:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    # Workers wait on it while the engine is idle; the engine's own sends time out sooner.
    meta_timeout = timeout_s if rank == 0 else WORKER_IDLE_S
    meta = dist.new_group(backend="gloo", timeout=timedelta(seconds=meta_timeout))
    return TPGroup(rank, world), meta


ShardFactory = Callable[[TPGroup, torch.device], CausalLM]


@dataclass(frozen=True)
class ShardOf:
    """A picklable shard factory: the whole model from `full()` (same weights on every rank:
    a seeded random_model, a small checkpoint), then this rank's shard."""

    full: Callable[[], CausalLM]

    def __call__(self, tp: TPGroup, device: torch.device) -> CausalLM:
        return shard_model(self.full(), tp, device)


@dataclass(frozen=True)
class CheckpointShard:
    """A rank's shard read straight from a checkpoint directory's safetensors."""

    path: str
    dtype: torch.dtype | None = None
    attention_backend: str = "auto"

    def __call__(self, tp: TPGroup, device: torch.device) -> CausalLM:
        return load_hf_checkpoint_shard(self.path, tp, device, self.dtype, self.attention_backend)


def _worker_main(
    rank: int,
    world: int,
    port: int,
    factory: ShardFactory,
    device: str,
    backend: str | None,
    timeout_s: float,
    configure: Callable[[CausalLM], None] | None,
) -> None:
    try:
        tp, meta = init_tp(rank, world, port, backend=backend, timeout_s=timeout_s)
        model = factory(tp, torch.device(device))
        if configure is not None:
            configure(model)
        serve_worker(model, meta)
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # never linger half-initialised: the engine sees a closed peer


def launch(
    factory: ShardFactory,
    world: int,
    devices: Sequence[str] | None = None,
    port: int | None = None,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    configure: Callable[[CausalLM], None] | None = None,
) -> CausalLM:
    """Spawns world - 1 worker ranks and returns rank 0's shard driving them (the model the
    engine uses). devices[r]: rank r's device (default: cuda:r on CUDA, else cpu). configure:
    applied to every rank's shard (switches such as model.executor.decode_padding must agree on
    all ranks).
    End with model.tp.shutdown()."""
    import multiprocessing as mp

    if devices is None:
        devices = [f"cuda:{r}" if torch.cuda.is_available() else "cpu" for r in range(world)]
    port = port or free_port()
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(1, world):
        args = (rank, world, port, factory, devices[rank], backend, timeout_s, configure)
        p = ctx.Process(target=_worker_main, args=args, daemon=True)
        p.start()
        procs.append(p)
    try:
        tp, meta = init_tp(0, world, port, backend=backend, timeout_s=timeout_s)
        model = factory(tp, torch.device(devices[0]))
        if configure is not None:
            configure(model)
    except BaseException:
        for p in procs:
            p.kill()
            p.join(5.0)
        raise
    return attach_driver(model, meta, procs, timeout_s)


def main(argv: Sequence[str] | None = None) -> None:
    """torchrun entry for worker ranks (RANK >= 1): `torchrun --nproc-per-node N -m
    tokencache_models.parallel.runtime --checkpoint DIR`, the engine being rank 0's own script."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S)
    args = ap.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rank == 0:
        raise SystemExit("rank 0 is the engine: it calls init_tp() and attach_driver()")
    port = int(os.environ["MASTER_PORT"])
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    tp, meta = init_tp(rank, world, port, addr, timeout_s=args.timeout_s)
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device(f"cuda:{local}" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    serve_worker(CheckpointShard(args.checkpoint, dtype)(tp, device), meta)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
