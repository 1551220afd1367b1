"""Two worker threads (as a small- and a large-model worker would) share one tree. The binding
releases the GIL around bulk calls; at the end no slot is lost or returned twice."""

from __future__ import annotations

import threading

import numpy as np

import tokencache as tc


def test_two_threads_share_one_tree() -> None:
    tree = tc.RadixTree()
    prompt = np.arange(256, dtype=np.int64)
    lock = threading.Lock()
    live: set[int] = set()
    next_slot = [0]
    errors: list[BaseException] = []

    def alloc(n: int) -> np.ndarray:
        with lock:
            start = next_slot[0]
            next_slot[0] += n
            live.update(range(start, start + n))
        return np.arange(start, start + n, dtype=np.int64)

    def free(slots: np.ndarray) -> None:
        with lock:
            for s in slots.tolist():
                assert s in live, f"slot {s} freed twice"
                live.remove(s)

    def worker(seed: int) -> None:
        try:
            rng = np.random.default_rng(seed)
            for _ in range(200):
                cur = tree.cursor()
                d = cur.extend(prompt, alloc(len(prompt)))
                if d is not None:
                    free(d.freed)
                for _ in range(10):
                    new = rng.integers(0, 4, size=8)
                    d = cur.extend(new, alloc(8))
                    if d is not None:
                        free(d.freed)
                free(cur.release())
                free(tree.evict(64))
        except BaseException as e:  # surfaced in the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    tree.check_invariants()
    assert tree.protected_size() == 0
    free(tree.evict(tree.total_size()))
    assert tree.total_size() == 0 and not live
