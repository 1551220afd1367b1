//! Criterion benchmarks of the core operations on the MISSION hand-off shape: a 512-token
//! shared prompt, requests growing by ~20 tokens per hand-off. Each timed hand-off is undone in
//! the same iteration (truncate / evict), so the tree stays the same size: millions of
//! iterations would otherwise measure page faults on fresh memory.
//!
//! `cargo bench -p tokencache-core --bench tree_ops`

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion};
use tokencache_core::{Cursor, RadixTree, TreeConfig};

const PROMPT: usize = 512;
const DELTA: usize = 20;

struct World {
    tree: RadixTree,
    cursors: Vec<Cursor>,
    next_slot: i64,
}

fn slots(next: &mut i64, n: usize) -> Vec<i64> {
    let v = (*next..*next + n as i64).collect();
    *next += n as i64;
    v
}

/// 32 requests sharing a prompt, each grown to `len` tokens in hand-offs of DELTA tokens.
fn world(len: usize, requests: usize) -> World {
    let tree = RadixTree::new(TreeConfig::default()).unwrap();
    let prompt: Vec<u32> = (0..PROMPT as u32).collect();
    let mut next = 0;
    let mut cursors = Vec::new();
    for r in 0..requests {
        let mut c = tree.cursor(None);
        c.extend(&prompt, &slots(&mut next, PROMPT)).unwrap();
        let mut step = 0u32;
        while c.length() < len {
            let t: Vec<u32> = (0..DELTA as u32)
                .map(|i| 10_000 + r as u32 * 997 + step + i)
                .collect();
            c.extend(&t, &slots(&mut next, DELTA)).unwrap();
            step += DELTA as u32;
        }
        cursors.push(c);
    }
    World {
        tree,
        cursors,
        next_slot: next,
    }
}

fn handoff(c: &mut Criterion) {
    let mut group = c.benchmark_group("handoff");
    for len in [512usize, 2048, 8192] {
        let mut w = world(len, 8);
        let mut tok = 1_000_000u32;
        group.bench_with_input(
            BenchmarkId::new("cursor_extend_truncate", len),
            &len,
            |b, _| {
                b.iter(|| {
                    let t: Vec<u32> = (0..DELTA as u32).map(|i| tok + i).collect();
                    tok += DELTA as u32;
                    let s = slots(&mut w.next_slot, DELTA);
                    black_box(w.cursors[0].extend(&t, &s).unwrap());
                    black_box(w.cursors[0].truncate(DELTA).unwrap());
                })
            },
        );
        // The SGLang way: match the whole sequence from the root, lock, insert, unlock.
        let mut w = world(len, 8);
        group.bench_with_input(BenchmarkId::new("readmit_evict", len), &len, |b, _| {
            b.iter(|| {
                let mut seq = w.cursors[1].tokens().unwrap();
                let t: Vec<u32> = (0..DELTA as u32).map(|i| tok + i).collect();
                tok += DELTA as u32;
                seq.extend_from_slice(&t);
                let mut all = w.cursors[1].slots().unwrap();
                all.extend(slots(&mut w.next_slot, DELTA));
                let m = w.tree.match_prefix(&seq, None);
                w.tree.lock(&m.node).unwrap();
                let r = w.tree.insert(&seq, &all, None, 0).unwrap();
                w.tree.unlock(&m.node).unwrap();
                black_box(r.prefix_len);
                black_box(w.tree.evict(DELTA)); // the only unpinned leaf is the one just added
            })
        });
    }
    group.finish();
}

fn batch(c: &mut Criterion) {
    let mut w = world(1024, 256);
    let mut tok = 2_000_000u32;
    c.bench_function("extend_many_256x20_then_truncate", |b| {
        b.iter(|| {
            let t: Vec<u32> = (0..256 * DELTA as u32).map(|i| tok + i).collect();
            tok += 256 * DELTA as u32;
            let offsets: Vec<usize> = (0..=256).map(|i| i * DELTA).collect();
            let s = slots(&mut w.next_slot, t.len());
            let mut refs: Vec<&mut Cursor> = w.cursors.iter_mut().collect();
            black_box(w.tree.extend_many(&mut refs, &offsets, &t, &s).unwrap());
            for c in &mut w.cursors {
                black_box(c.truncate(DELTA).unwrap());
            }
        })
    });
}

fn match_and_evict(c: &mut Criterion) {
    let w = world(2048, 32);
    let probe: Vec<u32> = w.cursors[3].tokens().unwrap();
    c.bench_function("match_prefix_2048", |b| {
        b.iter(|| black_box(w.tree.match_prefix(&probe, None)))
    });
    c.bench_function("insert_evict_512", |b| {
        let tree = RadixTree::new(TreeConfig::default()).unwrap();
        let mut next = 0i64;
        let mut base = 0u32;
        b.iter(|| {
            let t: Vec<u32> = (base..base + 512).collect();
            base += 512;
            tree.insert(&t, &slots(&mut next, 512), None, 0).unwrap();
            black_box(tree.evict(512));
        })
    });
}

criterion_group!(benches, handoff, batch, match_and_evict);
criterion_main!(benches);
