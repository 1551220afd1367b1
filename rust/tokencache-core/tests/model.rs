//! Model-based randomized test: random operation streams run against the tree and against a
//! deliberately naive reference that stores every cached prefix in a flat map. After every
//! operation: `check_invariants`, sizes, cached slots and every result must agree, and no slot
//! is ever lost or returned twice. A self-test plants bugs and proves the harness catches them.
//!
//! `PROPTEST_CASES=5000 cargo test --release --test model` runs a longer soak.

use std::collections::{BTreeSet, HashMap, HashSet};

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use tokencache_core::{Cursor, Error, EvictionPolicy, Fault, NodeHandle, RadixTree, TreeConfig};

type Ns = Option<&'static str>;
const NAMESPACES: [Ns; 2] = [None, Some("salt")];

#[derive(Debug, Clone)]
enum Op {
    Insert(usize, Vec<u32>),
    Match(usize, Vec<u32>),
    Lock(usize),
    Unlock(usize),
    Evict(usize),
    NewCursor(usize),
    CursorFromMatch(usize, Vec<u32>),
    Extend(usize, Vec<u32>),
    ExtendMany(Vec<(usize, Vec<u32>)>),
    Truncate(usize, usize),
    Release(usize),
    Reset,
}

fn tokens() -> impl Strategy<Value = Vec<u32>> {
    // A 2-3 token vocabulary makes shared prefixes, splits and duplicates common.
    prop::collection::vec(0u32..3, 0..10)
}

fn op() -> impl Strategy<Value = Op> {
    let ns = 0usize..2;
    prop_oneof![
        4 => (ns.clone(), tokens()).prop_map(|(n, t)| Op::Insert(n, t)),
        3 => (ns.clone(), tokens()).prop_map(|(n, t)| Op::Match(n, t)),
        2 => any::<usize>().prop_map(Op::Lock),
        2 => any::<usize>().prop_map(Op::Unlock),
        2 => (0usize..12).prop_map(Op::Evict),
        2 => ns.clone().prop_map(Op::NewCursor),
        1 => (ns, tokens()).prop_map(|(n, t)| Op::CursorFromMatch(n, t)),
        5 => (any::<usize>(), tokens()).prop_map(|(c, t)| Op::Extend(c, t)),
        1 => prop::collection::vec((any::<usize>(), tokens()), 0..4).prop_map(Op::ExtendMany),
        2 => (any::<usize>(), 0usize..8).prop_map(|(c, k)| Op::Truncate(c, k)),
        1 => any::<usize>().prop_map(Op::Release),
        1 => Just(Op::Reset),
    ]
}

type Prefix = (usize, Vec<u32>);

/// The naive reference: every cached page-aligned prefix (by namespace) maps to the slots of its
/// last page.
#[derive(Default)]
struct Reference {
    page: usize,
    cached: HashMap<Prefix, Vec<i64>>,
    locks: HashMap<Prefix, usize>,
}

impl Reference {
    fn aligned(&self, n: usize) -> usize {
        n / self.page * self.page
    }

    fn matched(&self, ns: usize, tokens: &[u32]) -> (usize, Vec<i64>) {
        let mut slots = Vec::new();
        for end in (self.page..=tokens.len()).step_by(self.page) {
            match self.cached.get(&(ns, tokens[..end].to_vec())) {
                Some(s) => slots.extend_from_slice(s),
                None => break,
            }
        }
        (slots.len(), slots)
    }

    fn protected(&self, pins: &[Prefix]) -> usize {
        self.cached
            .keys()
            .filter(|(ns, p)| pins.iter().any(|(pns, q)| pns == ns && q.starts_with(p)))
            .count()
            * self.page
    }

    fn size(&self) -> usize {
        self.cached.len() * self.page
    }

    fn insert_pages(&mut self, ns: usize, tokens: &[u32], slots: &[i64], from: usize, to: usize) {
        for end in (from + self.page..=to).step_by(self.page) {
            self.cached.insert(
                (ns, tokens[..end].to_vec()),
                slots[end - self.page..end].to_vec(),
            );
        }
    }

    fn prefix_of_slot(&self) -> HashMap<i64, Prefix> {
        self.cached
            .iter()
            .flat_map(|(k, v)| v.iter().map(move |&s| (s, k.clone())))
            .collect()
    }
}

struct RefCursor {
    cursor: Cursor,
    ns: usize,
    tokens: Vec<u32>,
    slots: Vec<i64>,
    stale: bool,
}

struct Harness {
    tree: RadixTree,
    reference: Reference,
    handles: Vec<(NodeHandle, Prefix, bool)>,
    cursors: Vec<RefCursor>,
    next_slot: i64,
    live: HashSet<i64>,
}

fn ensure(cond: bool, msg: impl Into<String>) -> Result<(), TestCaseError> {
    if cond {
        Ok(())
    } else {
        Err(TestCaseError::fail(msg.into()))
    }
}

impl Harness {
    fn new(page: usize, policy: EvictionPolicy, strict_slots: bool, fault: Option<Fault>) -> Self {
        let config = TreeConfig {
            page_size: page,
            policy,
            // Fresh slots never clash; this checks the held-slot set's bookkeeping.
            strict_slots,
            ..TreeConfig::default()
        };
        let tree = RadixTree::new(config).unwrap();
        if let Some(f) = fault {
            tree.plant_fault(f);
        }
        Self {
            tree,
            reference: Reference {
                page,
                ..Reference::default()
            },
            handles: Vec::new(),
            cursors: Vec::new(),
            next_slot: 0,
            live: HashSet::new(),
        }
    }

    fn fresh_slots(&mut self, n: usize) -> Vec<i64> {
        let s: Vec<i64> = (self.next_slot..self.next_slot + n as i64).collect();
        self.next_slot += n as i64;
        s
    }

    /// The caller's allocator gets slots back: each must be live, and only once.
    fn give_back(&mut self, slots: &[i64]) -> Result<(), TestCaseError> {
        for s in slots {
            ensure(
                self.live.remove(s),
                format!("slot {s} returned twice or never given"),
            )?;
        }
        Ok(())
    }

    fn pins(&self) -> Vec<Prefix> {
        let mut pins: Vec<Prefix> = self
            .reference
            .locks
            .iter()
            .filter(|(_, &n)| n > 0)
            .map(|(p, _)| p.clone())
            .collect();
        for c in self.cursors.iter().filter(|c| !c.stale) {
            let cached = self.reference.aligned(c.tokens.len());
            pins.push((c.ns, c.tokens[..cached].to_vec()));
        }
        pins
    }

    /// The reference forgets removed prefixes; handles to them die.
    fn forget(&mut self, slots: &[i64]) -> Result<(), TestCaseError> {
        let by_slot = self.reference.prefix_of_slot();
        let mut removed = HashSet::new();
        for s in slots {
            if let Some(p) = by_slot.get(s) {
                removed.insert(p.clone());
            }
        }
        for p in &removed {
            self.reference.cached.remove(p);
            for h in self.handles.iter_mut().filter(|h| &h.1 == p) {
                h.2 = false;
            }
        }
        // Nothing still pinned was removed, and no orphans were left behind.
        let pins = self.pins();
        for (ns, p) in &removed {
            let pinned = pins.iter().any(|(pns, q)| pns == ns && q.starts_with(p));
            ensure(!pinned, format!("a pinned prefix {p:?} was removed"))?;
        }
        for (ns, p) in self.reference.cached.keys() {
            if p.len() > self.reference.page {
                let parent = (*ns, p[..p.len() - self.reference.page].to_vec());
                ensure(
                    self.reference.cached.contains_key(&parent),
                    "removal orphaned a prefix",
                )?;
            }
        }
        Ok(())
    }

    fn check(&self) -> Result<(), TestCaseError> {
        self.tree.check_invariants().map_err(TestCaseError::fail)?;
        let sizes = self.tree.sizes();
        ensure(
            sizes.total == self.reference.size(),
            format!("total {sizes:?}"),
        )?;
        let protected = self.reference.protected(&self.pins());
        ensure(
            sizes.protected == protected,
            format!("protected {sizes:?} != {protected}"),
        )?;
        let tree_slots: BTreeSet<i64> = self.tree.all_slots().into_iter().collect();
        let ref_slots: BTreeSet<i64> = self.reference.cached.values().flatten().copied().collect();
        ensure(tree_slots == ref_slots, "cached slots differ")?;
        for c in self
            .cursors
            .iter()
            .filter(|c| !c.stale && !c.cursor.is_released())
        {
            ensure(c.cursor.length() == c.tokens.len(), "cursor length")?;
            ensure(c.cursor.slots().unwrap() == c.slots, "cursor slots")?;
        }
        Ok(())
    }

    fn extend_reference(&mut self, ci: usize, new: &[u32], slots: &[i64]) -> Vec<(i64, i64, i64)> {
        let page = self.reference.page;
        let c = &mut self.cursors[ci];
        let old_cached = c.tokens.len() / page * page;
        c.tokens.extend_from_slice(new);
        c.slots.extend_from_slice(slots);
        let end = c.tokens.len() / page * page;
        let mut dups = Vec::new();
        for start in (old_cached..end).step_by(page) {
            let key = (c.ns, c.tokens[..start + page].to_vec());
            match self.reference.cached.get(&key) {
                Some(tree) => {
                    for (j, &s) in tree.iter().enumerate() {
                        if s != c.slots[start + j] {
                            dups.push(((start + j) as i64, c.slots[start + j], s));
                            c.slots[start + j] = s;
                        }
                    }
                }
                None => {
                    self.reference
                        .cached
                        .insert(key, c.slots[start..start + page].to_vec());
                }
            }
        }
        dups
    }

    fn pick_cursor(&self, i: usize) -> Option<usize> {
        let open: Vec<usize> = (0..self.cursors.len())
            .filter(|&c| !self.cursors[c].cursor.is_released())
            .collect();
        (!open.is_empty()).then(|| open[i % open.len()])
    }

    fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match op {
            Op::Insert(ns, t) => {
                let slots = self.fresh_slots(t.len());
                let aligned = self.reference.aligned(t.len());
                let (expect, _) = self.reference.matched(*ns, t);
                let r = self.tree.insert(t, &slots, NAMESPACES[*ns], 0).unwrap();
                ensure(
                    r.prefix_len == expect,
                    format!("insert prefix {} != {expect}", r.prefix_len),
                )?;
                self.reference.insert_pages(*ns, t, &slots, expect, aligned);
                self.live.extend(&slots[expect..aligned]);
                self.handles
                    .push((r.node, (*ns, t[..aligned].to_vec()), true));
            }
            Op::Match(ns, t) => {
                let (len, slots) = self.reference.matched(*ns, t);
                // The question first: the same length, and the tree unchanged by it.
                let nodes = self.tree.node_count();
                let asked = self.tree.cached_prefix_len(t, NAMESPACES[*ns]);
                ensure(
                    asked == len && self.tree.node_count() == nodes,
                    format!("cached_prefix_len {asked} != {len}, or it changed the tree"),
                )?;
                let m = self.tree.match_prefix(t, NAMESPACES[*ns]);
                ensure(
                    m.length == len && m.slots == slots,
                    format!("match {} != {len}", m.length),
                )?;
                self.handles.push((m.node, (*ns, t[..len].to_vec()), true));
            }
            Op::Lock(i) | Op::Unlock(i) if !self.handles.is_empty() => {
                let (h, prefix, alive) = self.handles[i % self.handles.len()].clone();
                let locks = *self.reference.locks.get(&prefix).unwrap_or(&0);
                let result = if matches!(op, Op::Lock(_)) {
                    self.tree.lock(&h).map(|_| 1isize)
                } else {
                    let cursor_pins = self
                        .cursors
                        .iter()
                        .filter(|c| !c.stale && !c.cursor.is_released() && c.ns == prefix.0)
                        .filter(|c| {
                            c.tokens[..self.reference.aligned(c.tokens.len())] == prefix.1[..]
                        })
                        .count();
                    if locks == 0 && cursor_pins > 0 {
                        return Ok(()); // would steal a cursor's pin: not a meaningful op
                    }
                    self.tree.unlock(&h).map(|_| -1)
                };
                match result {
                    Ok(d) => {
                        ensure(alive, "lock/unlock on a dead handle succeeded")?;
                        *self.reference.locks.entry(prefix).or_default() =
                            (locks as isize + d) as usize;
                    }
                    Err(Error::StaleHandle(_)) => ensure(!alive, "live handle reported stale")?,
                    Err(Error::LockState(_)) => ensure(locks == 0, "unlock refused while locked")?,
                    Err(e) => return Err(TestCaseError::fail(format!("unexpected {e}"))),
                }
            }
            Op::Lock(_) | Op::Unlock(_) => {}
            Op::Evict(n) => {
                let evictable = self.tree.sizes().evictable;
                let freed = self.tree.evict(*n);
                ensure(freed.len() >= (*n).min(evictable), "evicted too little")?;
                self.give_back(&freed)?;
                self.forget(&freed)?;
            }
            Op::NewCursor(ns) => {
                let cursor = self.tree.cursor(NAMESPACES[*ns]);
                self.cursors.push(RefCursor {
                    cursor,
                    ns: *ns,
                    tokens: vec![],
                    slots: vec![],
                    stale: false,
                });
            }
            Op::CursorFromMatch(ns, t) => {
                let m = self.tree.match_prefix(t, NAMESPACES[*ns]);
                let cursor = self.tree.cursor_at(&m.node).unwrap();
                let tokens = t[..m.length].to_vec();
                self.cursors.push(RefCursor {
                    cursor,
                    ns: *ns,
                    tokens,
                    slots: m.slots,
                    stale: false,
                });
            }
            Op::Extend(i, t) => {
                let Some(ci) = self.pick_cursor(*i) else {
                    return Ok(());
                };
                let slots = self.fresh_slots(t.len());
                let r = self.cursors[ci].cursor.extend(t, &slots);
                if self.cursors[ci].stale {
                    return ensure(
                        matches!(r, Err(Error::StaleHandle(_))),
                        "stale cursor extended",
                    );
                }
                let d = r.unwrap();
                self.live.extend(&slots);
                let want = self.extend_reference(ci, t, &slots);
                let got: Vec<_> = (0..d.len())
                    .map(|k| (d.positions[k], d.freed[k], d.slots[k]))
                    .collect();
                ensure(got == want, format!("dedup {got:?} != {want:?}"))?;
                self.give_back(&d.freed)?;
            }
            Op::ExtendMany(parts) => {
                let mut picked: Vec<(usize, &Vec<u32>)> = Vec::new();
                for (i, t) in parts {
                    if let Some(ci) = self.pick_cursor(*i) {
                        if !self.cursors[ci].stale && !picked.iter().any(|(c, _)| *c == ci) {
                            picked.push((ci, t));
                        }
                    }
                }
                let all: Vec<u32> = picked.iter().flat_map(|(_, t)| t.iter().copied()).collect();
                let slots = self.fresh_slots(all.len());
                let mut offsets = vec![0];
                for (_, t) in &picked {
                    offsets.push(offsets.last().unwrap() + t.len());
                }
                let mut order: Vec<usize> = picked.iter().map(|(c, _)| *c).collect();
                let mut ranked: Vec<(usize, &mut Cursor)> = self
                    .cursors
                    .iter_mut()
                    .enumerate()
                    .filter_map(|(i, c)| {
                        order
                            .iter()
                            .position(|&o| o == i)
                            .map(|k| (k, &mut c.cursor))
                    })
                    .collect();
                ranked.sort_by_key(|(k, _)| *k);
                let mut refs: Vec<&mut Cursor> = ranked.into_iter().map(|(_, c)| c).collect();
                let d = self
                    .tree
                    .extend_many(&mut refs, &offsets, &all, &slots)
                    .unwrap();
                self.live.extend(&slots);
                let mut want = Vec::new();
                for (k, ci) in order.drain(..).enumerate() {
                    let (a, b) = (offsets[k], offsets[k + 1]);
                    for (p, f, s) in self.extend_reference(ci, &all[a..b], &slots[a..b]) {
                        want.push((k as i64, p, f, s));
                    }
                }
                let got: Vec<_> = (0..d.len())
                    .map(|k| (d.request[k], d.positions[k], d.freed[k], d.slots[k]))
                    .collect();
                ensure(got == want, format!("batch dedup {got:?} != {want:?}"))?;
                self.give_back(&d.freed)?;
            }
            Op::Truncate(i, k) => {
                let Some(ci) = self.pick_cursor(*i) else {
                    return Ok(());
                };
                let before = (self.tree.all_slots(), self.tree.sizes());
                let len = self.cursors[ci].tokens.len();
                match self.cursors[ci].cursor.truncate(*k) {
                    Ok(freed) => {
                        ensure(
                            !self.cursors[ci].stale && *k <= len,
                            "bad truncate accepted",
                        )?;
                        let target = len - k;
                        let c = &mut self.cursors[ci];
                        let dropped: HashSet<i64> = c.slots[target..].iter().copied().collect();
                        ensure(
                            freed.iter().all(|s| dropped.contains(s)),
                            "freed a kept slot",
                        )?;
                        c.tokens.truncate(target);
                        c.slots.truncate(target);
                        // A partial last page leaves the tree and becomes the cursor's own tail.
                        let tail = c.slots[self.reference.aligned(target)..].to_vec();
                        self.give_back(&freed)?;
                        self.forget(&[freed, tail].concat())?;
                    }
                    Err(Error::StaleHandle(_)) => {
                        ensure(self.cursors[ci].stale, "live cursor stale")?
                    }
                    Err(Error::InvalidArgument(_)) => ensure(*k > len, "valid truncate refused")?,
                    Err(Error::PageAlignment(_)) => {
                        ensure(
                            (len - k) % self.reference.page != 0,
                            "aligned truncate refused",
                        )?;
                        ensure(
                            before == (self.tree.all_slots(), self.tree.sizes()),
                            "refusal changed the tree",
                        )?;
                    }
                    Err(e) => return Err(TestCaseError::fail(format!("unexpected {e}"))),
                }
            }
            Op::Release(i) => {
                let Some(ci) = self.pick_cursor(*i) else {
                    return Ok(());
                };
                let returned = self.cursors[ci].cursor.release().unwrap();
                let c = &self.cursors[ci];
                let cached = if c.stale {
                    0
                } else {
                    self.reference.aligned(c.tokens.len())
                };
                let owned = if c.stale {
                    c.slots[self.reference.aligned(c.slots.len())..].to_vec()
                } else {
                    c.slots[cached..].to_vec()
                };
                ensure(
                    returned == owned,
                    format!("release returned {returned:?}, owned {owned:?}"),
                )?;
                self.give_back(&returned)?;
                self.cursors[ci].stale = true;
            }
            Op::Reset => {
                let all = self.tree.reset();
                self.give_back(&all)?;
                self.reference.cached.clear();
                self.reference.locks.clear();
                for h in &mut self.handles {
                    h.2 = false;
                }
                for c in &mut self.cursors {
                    c.stale = true;
                }
            }
        }
        self.check()
    }

    /// Release everything and evict all: every slot must come back exactly once.
    fn drain(&mut self) -> Result<(), TestCaseError> {
        for (prefix, n) in std::mem::take(&mut self.reference.locks) {
            for (h, p, alive) in self.handles.clone() {
                if p == prefix && alive {
                    for _ in 0..n {
                        self.tree
                            .unlock(&h)
                            .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    }
                    break;
                }
            }
        }
        for i in 0..self.cursors.len() {
            if !self.cursors[i].cursor.is_released() {
                let owned = self.cursors[i].cursor.release().unwrap();
                self.give_back(&owned)?;
            }
        }
        let freed = self.tree.evict(usize::MAX);
        self.give_back(&freed)?;
        self.tree.check_invariants().map_err(TestCaseError::fail)?;
        ensure(
            self.tree.sizes().total == 0,
            "tree not empty after draining",
        )?;
        ensure(
            self.live.is_empty(),
            format!("{} slots leaked", self.live.len()),
        )
    }
}

fn run(
    page: usize,
    policy: EvictionPolicy,
    strict_slots: bool,
    fault: Option<Fault>,
    ops: &[Op],
) -> Result<(), TestCaseError> {
    let mut h = Harness::new(page, policy, strict_slots, fault);
    for op in ops {
        h.apply(op)?;
    }
    h.drain()
}

fn policies() -> impl Strategy<Value = EvictionPolicy> {
    prop_oneof![
        Just(EvictionPolicy::Lru),
        Just(EvictionPolicy::Lfu),
        Just(EvictionPolicy::Fifo)
    ]
}

proptest! {
    #![proptest_config(Config { cases: 400, ..Config::default() })]

    #[test]
    fn tree_matches_reference(
        page in prop_oneof![Just(1usize), Just(2), Just(4)],
        policy in policies(),
        strict_slots in any::<bool>(),
        ops in prop::collection::vec(op(), 1..60),
    ) {
        run(page, policy, strict_slots, None, &ops)?;
    }
}

/// The harness must catch deliberately broken trees, or a green run means nothing.
#[test]
fn harness_catches_planted_bugs() {
    for fault in [Fault::SkipParentOnUnprotect, Fault::ShortMatch] {
        let mut runner = TestRunner::new(Config {
            cases: 400,
            failure_persistence: None,
            ..Config::default()
        });
        let strategy = (
            prop_oneof![Just(1usize), Just(2)],
            prop::collection::vec(op(), 1..60),
        );
        let result = runner.run(&strategy, |(page, ops)| {
            run(page, EvictionPolicy::Lru, false, Some(fault), &ops)
        });
        assert!(result.is_err(), "planted fault {fault:?} went unnoticed");
    }
}
