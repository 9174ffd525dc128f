//! Which KV blocks are free, which are shared, and which hold a reusable prefix.
//!
//! A block is keyed by a hash chain over the tokens of every block up to and including it and the
//! toggles that change KV numbers ([`Toggles::kv_key`]), so a key names exactly one content: two
//! requests whose prompts agree on the first `n` full blocks under the same toggles share those
//! blocks. Unreferenced keyed blocks stay cached and are evicted least recently used first.
//!
//! [`Toggles::kv_key`]: crate::toggles::Toggles::kv_key

use std::collections::{BTreeMap, HashMap};

use sha2::{Digest, Sha256};

/// A block's content key (128 bits of SHA-256 over the chain).
pub type BlockKey = [u8; 16];

/// Keys of consecutive full blocks of `tokens`: `(exact, stale)` per block, where the stale key
/// leaves out each block's last token (what the `fault.prefix_cache=stale` lookup uses).
pub fn block_keys(tokens: &[u32], block_size: usize, kv_key: &str) -> Vec<(BlockKey, BlockKey)> {
    let mut prev = (
        Sha256::digest(kv_key.as_bytes()),
        Sha256::digest(kv_key.as_bytes()),
    );
    let mut keys = Vec::with_capacity(tokens.len() / block_size);
    for block in tokens.chunks_exact(block_size) {
        let mut exact = Sha256::new();
        exact.update(prev.0);
        let mut stale = Sha256::new();
        stale.update(prev.1);
        for (i, t) in block.iter().enumerate() {
            exact.update(t.to_le_bytes());
            if i + 1 < block_size {
                stale.update(t.to_le_bytes());
            }
        }
        prev = (exact.finalize(), stale.finalize());
        let mut k = ([0u8; 16], [0u8; 16]);
        k.0.copy_from_slice(&prev.0[..16]);
        k.1.copy_from_slice(&prev.1[..16]);
        keys.push(k);
    }
    keys
}

/// Counters of the prefix cache, for `/metrics` and benchmarks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheCounters {
    /// Blocks found in the cache at admission.
    pub hit_blocks: u64,
    /// Full prompt blocks looked up and not found.
    pub miss_blocks: u64,
    /// Cached blocks evicted to make room.
    pub evictions: u64,
}

/// Allocation, sharing and eviction of the blocks of one [`KvPool`].
///
/// [`KvPool`]: crate::model::KvPool
#[derive(Debug)]
pub struct BlockManager {
    refcount: Vec<u32>,
    /// Blocks holding nothing reusable.
    free: Vec<u32>,
    /// The keys a block is registered under.
    key_of: Vec<Option<(BlockKey, BlockKey)>>,
    exact: HashMap<BlockKey, u32>,
    stale: HashMap<BlockKey, u32>,
    /// Cached, unreferenced blocks by last use (eviction order).
    lru: BTreeMap<u64, u32>,
    lru_tick: Vec<Option<u64>>,
    tick: u64,
    /// Counters.
    pub counters: CacheCounters,
}

impl BlockManager {
    /// A manager of `n` blocks, all free.
    pub fn new(n: usize) -> Self {
        BlockManager {
            refcount: vec![0; n],
            free: (0..n as u32).rev().collect(),
            key_of: vec![None; n],
            exact: HashMap::new(),
            stale: HashMap::new(),
            lru: BTreeMap::new(),
            lru_tick: vec![None; n],
            tick: 0,
            counters: CacheCounters::default(),
        }
    }

    /// Total blocks.
    pub fn total(&self) -> usize {
        self.refcount.len()
    }

    /// Blocks that an allocation could get now (free, or cached and evictable).
    pub fn available(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    /// Blocks referenced by at least one sequence.
    pub fn in_use(&self) -> usize {
        self.total() - self.available()
    }

    /// Blocks holding a cached prefix nobody references.
    pub fn cached_idle(&self) -> usize {
        self.lru.len()
    }

    fn unregister(&mut self, b: u32) {
        if let Some((e, s)) = self.key_of[b as usize].take() {
            if self.exact.get(&e) == Some(&b) {
                self.exact.remove(&e);
            }
            if self.stale.get(&s) == Some(&b) {
                self.stale.remove(&s);
            }
        }
    }

    /// Takes one block, evicting the least recently used cached block if none is free.
    pub fn allocate(&mut self) -> Option<u32> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let (&t, &b) = self.lru.iter().next()?;
                self.lru.remove(&t);
                self.lru_tick[b as usize] = None;
                self.unregister(b);
                self.counters.evictions += 1;
                b
            }
        };
        self.refcount[b as usize] = 1;
        Some(b)
    }

    /// Finds the longest run of cached blocks matching `keys` from the start and takes a
    /// reference to each. With `stale`, lookups use the keys that ignore each block's last token.
    pub fn lookup(&mut self, keys: &[(BlockKey, BlockKey)], stale: bool) -> Vec<u32> {
        let mut found = Vec::new();
        for k in keys {
            let hit = if stale {
                self.stale.get(&k.1)
            } else {
                self.exact.get(&k.0)
            };
            let Some(&b) = hit else { break };
            found.push(b);
        }
        for &b in &found {
            self.take_ref(b);
        }
        self.counters.hit_blocks += found.len() as u64;
        self.counters.miss_blocks += (keys.len() - found.len()) as u64;
        found
    }

    fn take_ref(&mut self, b: u32) {
        if let Some(t) = self.lru_tick[b as usize].take() {
            self.lru.remove(&t);
        }
        self.refcount[b as usize] += 1;
    }

    /// Records that block `b` now holds the content named by `key`, so later requests can reuse
    /// it. A content already cached in another block keeps that block.
    pub fn register(&mut self, b: u32, key: (BlockKey, BlockKey)) {
        if self.key_of[b as usize].is_some() || self.exact.contains_key(&key.0) {
            return;
        }
        self.exact.insert(key.0, b);
        self.stale.entry(key.1).or_insert(b);
        self.key_of[b as usize] = Some(key);
    }

    /// Drops one reference; an unreferenced block is kept as cache if it has a key, else freed.
    pub fn release(&mut self, b: u32) {
        let rc = &mut self.refcount[b as usize];
        debug_assert!(*rc > 0, "release of unreferenced block {b}");
        *rc = rc.saturating_sub(1);
        if *rc == 0 {
            if self.key_of[b as usize].is_some() {
                self.tick += 1;
                self.lru.insert(self.tick, b);
                self.lru_tick[b as usize] = Some(self.tick);
            } else {
                self.free.push(b);
            }
        }
    }

    /// Forgets every cached prefix (blocks in use keep their content but lose their keys).
    pub fn clear_cache(&mut self) {
        for b in 0..self.total() as u32 {
            self.unregister(b);
        }
        while let Some((_, b)) = self.lru.pop_first() {
            self.lru_tick[b as usize] = None;
            self.free.push(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_prefix_blocks_and_evicts_lru() {
        let mut m = BlockManager::new(4);
        let a: Vec<u32> = (0..32).collect();
        let keys = block_keys(&a, 16, "");
        let b0 = m.allocate().unwrap();
        let b1 = m.allocate().unwrap();
        m.register(b0, keys[0]);
        m.register(b1, keys[1]);
        m.release(b0);
        m.release(b1);
        assert_eq!(m.cached_idle(), 2);
        // Same prefix: both blocks found, in order.
        assert_eq!(m.lookup(&keys, false), vec![b0, b1]);
        assert_eq!(m.available(), 2);
        m.release(b0);
        m.release(b1);
        // A prompt differing in the last token of block 0 misses exactly...
        let mut c = a.clone();
        c[15] = 999;
        let ck = block_keys(&c, 16, "");
        assert!(m.lookup(&ck, false).is_empty());
        // ...but the stale fault reuses block 0 (and chains into block 1).
        assert_eq!(m.lookup(&ck, true), vec![b0, b1]);
        m.release(b0);
        m.release(b1);
        // Different toggles never share.
        assert!(m
            .lookup(&block_keys(&a, 16, "matmul=bf16"), false)
            .is_empty());
        // Allocating everything evicts the cached blocks, least recently used first.
        let got: Vec<u32> = (0..4).map(|_| m.allocate().unwrap()).collect();
        assert_eq!(got.len(), 4);
        assert!(m.allocate().is_none());
        assert_eq!(m.counters.evictions, 2);
        assert!(m.lookup(&keys, false).is_empty());
    }
}
