"""`python -m tokencache`: a one-minute demo of why cursors matter, on a built-in trace.

Requests share a 512-token system prompt; after every ~1/p tokens a request is handed back from
the large model and appends what was written meanwhile. We time each hand-off two ways on the
same tree: re-admission from the root (match + lock + insert + unlock, as engines do today) and
a resumable cursor (one extend of the new tokens).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import tokencache as tc


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tokencache", description=__doc__)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--p", type=float, default=0.05, help="escalation probability per token")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--rounds", type=int, default=8, help="timed hand-offs per request and L")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(0, 32000, args.prompt)
    next_slot = 0

    def slots(n: int) -> np.ndarray:
        nonlocal next_slot
        next_slot += n
        return np.arange(next_slot - n, next_slot, dtype=np.int64)

    def delta() -> np.ndarray:
        return rng.integers(0, 32000, max(1, int(rng.geometric(args.p))))

    print(f"{args.requests} requests, {args.prompt}-token shared prompt, p={args.p}")
    print("median microseconds per hand-off, same tree, same trace")
    print(f"{'L':>6} {'re-admit':>10} {'cursor':>8} {'ratio':>7}")
    tree = tc.RadixTree()
    cursors = [tree.cursor() for _ in range(args.requests)]
    for c in cursors:
        c.extend(prompt, slots(len(prompt)))
    for target in sorted(args.lengths):
        for c in cursors:  # grow every request to about L (not timed)
            while c.length < target:
                c.extend(d := delta(), slots(len(d)))
        readmit, cursor = [], []
        for i, c in enumerate(cursors * args.rounds):
            new_tokens = delta()
            new = slots(len(new_tokens))
            if i % 2:  # re-admission from the root, as engines do today
                seq = np.concatenate([c.tokens(), new_tokens])
                all_slots = np.concatenate([c.slots(), new])
                t0 = time.perf_counter_ns()
                m = tree.match_prefix(seq)
                tree.lock(m.node)
                tree.insert(seq, all_slots)
                tree.unlock(m.node)
                readmit.append(time.perf_counter_ns() - t0)
                c.extend(new_tokens, new)  # keep this request's cursor in step (not timed)
            else:
                t0 = time.perf_counter_ns()
                c.extend(new_tokens, new)
                cursor.append(time.perf_counter_ns() - t0)
        r, k = np.median(readmit) / 1e3, np.median(cursor) / 1e3
        print(f"{target:>6} {r:>10.2f} {k:>8.2f} {r / k:>6.1f}x")
    tree.check_invariants()


if __name__ == "__main__":
    main()
