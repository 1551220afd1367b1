//! Several threads extend, truncate, pin and release cursors while another evicts. At
//! quiescence no slot is lost or freed twice and the sizes are exact.
//!
//! `STRESS_ROUNDS=200000 cargo test --release --test stress` soaks longer.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokencache_core::{Cursor, Error, RadixTree, TreeConfig};

fn assert_send_sync<T: Send + Sync>() {}
fn assert_send<T: Send>() {}

#[test]
fn types_cross_threads() {
    assert_send_sync::<RadixTree>();
    assert_send::<Cursor>();
}

/// The caller's slot allocator: every slot handed to the tree must come back exactly once.
struct Slots {
    next: AtomicI64,
    live: Mutex<HashSet<i64>>,
}

impl Slots {
    fn alloc(&self, n: usize) -> Vec<i64> {
        let start = self.next.fetch_add(n as i64, Ordering::Relaxed);
        let v: Vec<i64> = (start..start + n as i64).collect();
        self.live.lock().unwrap().extend(&v);
        v
    }

    fn free(&self, slots: &[i64]) {
        let mut live = self.live.lock().unwrap();
        for s in slots {
            assert!(live.remove(s), "slot {s} freed twice or never allocated");
        }
    }
}

fn rounds() -> usize {
    std::env::var("STRESS_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20000)
}

fn worker(tree: RadixTree, slots: Arc<Slots>, seed: u64, prompt: Arc<Vec<u32>>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut cursors: Vec<Cursor> = Vec::new();
    for _ in 0..rounds() {
        match rng.gen_range(0..10) {
            0 | 1 if cursors.len() < 8 => {
                let mut c = tree.cursor(None);
                let s = slots.alloc(prompt.len());
                let d = c.extend(&prompt, &s).unwrap();
                slots.free(&d.freed);
                cursors.push(c);
            }
            2..=5 if !cursors.is_empty() => {
                let i = rng.gen_range(0..cursors.len());
                let n = rng.gen_range(1..24);
                let t: Vec<u32> = (0..n).map(|_| rng.gen_range(0..3)).collect();
                let s = slots.alloc(n);
                let d = cursors[i].extend(&t, &s).unwrap();
                slots.free(&d.freed);
            }
            6 if !cursors.is_empty() => {
                let i = rng.gen_range(0..cursors.len());
                let k = rng.gen_range(0..=cursors[i].length().min(16));
                slots.free(&cursors[i].truncate(k).unwrap());
            }
            7 => {
                // Lock-free pin / unpin of a matched node.
                let m = tree.match_prefix(&prompt[..rng.gen_range(0..prompt.len())], None);
                match tree.pin(&m.node) {
                    Ok(()) => tree.unpin(&m.node).unwrap(),
                    Err(Error::StaleHandle(_)) => {} // evicted in between: fine
                    Err(e) => panic!("{e}"),
                }
            }
            8 | 9 if !cursors.is_empty() => {
                let i = rng.gen_range(0..cursors.len());
                let mut c = cursors.swap_remove(i);
                slots.free(&c.release().unwrap());
            }
            _ => {}
        }
    }
    for mut c in cursors {
        slots.free(&c.release().unwrap());
    }
}

#[test]
fn threads_extend_pin_and_evict_without_losing_slots() {
    let tree = RadixTree::new(TreeConfig::default()).unwrap();
    let slots = Arc::new(Slots {
        next: AtomicI64::new(0),
        live: Mutex::new(HashSet::new()),
    });
    let prompt: Arc<Vec<u32>> = Arc::new((0..64).map(|i| 100 + i).collect());
    let stop = Arc::new(AtomicBool::new(false));

    let evictor = {
        let (tree, slots, stop) = (tree.clone(), slots.clone(), stop.clone());
        thread::spawn(move || {
            let mut evicted = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let freed = tree.evict(16);
                evicted += freed.len();
                slots.free(&freed);
                thread::yield_now();
            }
            evicted
        })
    };
    let workers: Vec<_> = (0..4)
        .map(|seed| {
            let (tree, slots, prompt) = (tree.clone(), slots.clone(), prompt.clone());
            thread::spawn(move || worker(tree, slots, seed, prompt))
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    let evicted = evictor.join().unwrap();
    assert!(evicted > 0, "the evictor never raced the workers");

    tree.check_invariants().unwrap();
    let sizes = tree.sizes();
    assert_eq!(sizes.protected, 0, "every cursor was released");
    assert_eq!(sizes.evictable, sizes.total);
    slots.free(&tree.evict(usize::MAX));
    tree.check_invariants().unwrap();
    assert_eq!(tree.sizes().total, 0);
    assert!(slots.live.lock().unwrap().is_empty(), "slots leaked");
}
