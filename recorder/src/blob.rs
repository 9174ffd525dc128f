//! Compact binary encodings of the per-token columns of a recorded request: token IDs, per-token
//! time offsets and logits summaries.
//!
//! A long agent session records hundreds of thousands of prompt token IDs per turn; as JSON that
//! is ~6 bytes a token and slow to parse, so these columns are BLOBs in a small self-describing
//! format. Every blob starts with a **magic byte** naming what it holds and a **version byte**, so
//! a reader can refuse a blob it does not understand instead of misreading it. The decoder never
//! panics: bad magic, unknown version, truncation, overlong varints, absurd counts and trailing
//! bytes are all [`BlobError`]s.
//!
//! # Primitives
//!
//! * `varint`: unsigned LEB128 (7 bits a byte, least significant group first, high bit = more),
//!   at most 10 bytes for a `u64`.
//! * `zigzag`: signed to unsigned as `(n << 1) ^ (n >> 63)`, so small negative numbers stay small.
//! * `f32`: IEEE-754 binary32, little-endian, 4 bytes (bit-exact: NaN payloads survive).
//!
//! # Kinds (version 1)
//!
//! | kind | magic | body |
//! |---|---|---|
//! | token IDs | `0x54` (`T`) | `varint n`, then `n` × `varint zigzag(id[i] - id[i-1])` with `id[-1] = 0` |
//! | time offsets (µs) | `0x4D` (`M`) | `varint n`, then `n` × `varint zigzag(t[i] - t[i-1])` with `t[-1] = 0` |
//! | logits summaries | `0x4C` (`L`) | `varint n`, then `n` × entry |
//!
//! A logits entry is `f32 logprob` (of the chosen or given token), `f32 entropy` (nats, full
//! distribution), `varint k`, then `k` × (`varint token id`, `f32 logprob`), most likely first.
//!
//! Delta coding makes a run of nearby IDs (digits, whitespace, repeated code) and monotonic time
//! offsets one or two bytes each; zigzag keeps a decrease cheap and never an error.
//! The same description is in `recorder/FORMAT.md`.

use tapedeck_engine::LogitsSummary;

/// Magic byte of a token-ID blob.
pub const MAGIC_TOKENS: u8 = b'T';
/// Magic byte of a time-offset blob.
pub const MAGIC_TIMES: u8 = b'M';
/// Magic byte of a logits-summary blob.
pub const MAGIC_LOGITS: u8 = b'L';
/// The only version written and read so far.
pub const VERSION: u8 = 1;

/// Why a blob could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlobError {
    /// The blob is empty or shorter than its two header bytes.
    #[error("blob too short for its header ({len} bytes)")]
    NoHeader {
        /// Length of the blob.
        len: usize,
    },
    /// The first byte names a different kind of blob.
    #[error("bad magic byte {found:#04x} (expected {expected:#04x})")]
    BadMagic {
        /// The magic of the kind asked for.
        expected: u8,
        /// The byte found.
        found: u8,
    },
    /// The version byte is one this build cannot read.
    #[error("unsupported blob version {found} (this build reads version {VERSION})")]
    UnsupportedVersion {
        /// The version found.
        found: u8,
    },
    /// The data ends in the middle of a value.
    #[error("blob truncated at byte {offset}")]
    Truncated {
        /// Offset where more bytes were needed.
        offset: usize,
    },
    /// A varint is longer than 10 bytes or overflows its type.
    #[error("malformed varint at byte {offset}")]
    BadVarint {
        /// Offset where the varint starts.
        offset: usize,
    },
    /// A count or value is impossible for the bytes that remain (e.g. a count of 2^40 elements in
    /// 12 bytes): refused before allocating.
    #[error("implausible {what} {value} at byte {offset}")]
    Implausible {
        /// What was being read.
        what: &'static str,
        /// The value read.
        value: u64,
        /// Offset after the value.
        offset: usize,
    },
    /// Bytes remain after the last element.
    #[error("{extra} trailing bytes after the last element")]
    TrailingBytes {
        /// How many.
        extra: usize,
    },
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn zigzag(n: i64) -> u64 {
    ((n << 1) ^ (n >> 63)) as u64
}

fn unzigzag(v: u64) -> i64 {
    ((v >> 1) as i64) ^ -((v & 1) as i64)
}

fn header(magic: u8, n: usize, per_item: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(2 + 10 + n * per_item);
    out.push(magic);
    out.push(VERSION);
    put_varint(&mut out, n as u64);
    out
}

/// Encodes token IDs (prompt or output) as a token-ID blob.
pub fn encode_tokens(ids: &[u32]) -> Vec<u8> {
    let mut out = header(MAGIC_TOKENS, ids.len(), 3);
    let mut prev = 0i64;
    for &id in ids {
        let id = i64::from(id);
        put_varint(&mut out, zigzag(id - prev));
        prev = id;
    }
    out
}

/// Encodes per-token time offsets in microseconds as a time-offset blob.
pub fn encode_times(offsets_us: &[u64]) -> Vec<u8> {
    let mut out = header(MAGIC_TIMES, offsets_us.len(), 2);
    let mut prev = 0i64;
    for &t in offsets_us {
        // Offsets past i64::MAX µs (292k years) are clamped rather than wrapped.
        let t = i64::try_from(t).unwrap_or(i64::MAX);
        put_varint(&mut out, zigzag(t.wrapping_sub(prev)));
        prev = t;
    }
    out
}

/// Encodes logits summaries as a logits-summary blob.
pub fn encode_logits(summaries: &[LogitsSummary]) -> Vec<u8> {
    let mut out = header(MAGIC_LOGITS, summaries.len(), 9 + 8 * 7);
    for s in summaries {
        out.extend_from_slice(&s.logprob.to_le_bytes());
        out.extend_from_slice(&s.entropy.to_le_bytes());
        put_varint(&mut out, s.top.len() as u64);
        for &(id, lp) in &s.top {
            put_varint(&mut out, u64::from(id));
            out.extend_from_slice(&lp.to_le_bytes());
        }
    }
    out
}

/// A cursor over a blob's bytes that turns every short read into an error.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn open(buf: &'a [u8], magic: u8) -> Result<Self, BlobError> {
        if buf.len() < 2 {
            return Err(BlobError::NoHeader { len: buf.len() });
        }
        if buf[0] != magic {
            return Err(BlobError::BadMagic {
                expected: magic,
                found: buf[0],
            });
        }
        if buf[1] != VERSION {
            return Err(BlobError::UnsupportedVersion { found: buf[1] });
        }
        Ok(Reader { buf, pos: 2 })
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn varint(&mut self) -> Result<u64, BlobError> {
        let start = self.pos;
        let mut v = 0u64;
        for i in 0..10 {
            let b = *self
                .buf
                .get(self.pos)
                .ok_or(BlobError::Truncated { offset: self.pos })?;
            self.pos += 1;
            let bits = u64::from(b & 0x7f);
            // The tenth byte may only carry the top bit of a u64.
            if i == 9 && bits > 1 {
                return Err(BlobError::BadVarint { offset: start });
            }
            v |= bits << (7 * i);
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(BlobError::BadVarint { offset: start })
    }

    fn f32(&mut self) -> Result<f32, BlobError> {
        let bytes = self
            .buf
            .get(self.pos..self.pos + 4)
            .ok_or(BlobError::Truncated { offset: self.pos })?;
        self.pos += 4;
        Ok(f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
    }

    /// Reads a count and checks that `min_bytes` per element still fit.
    fn count(&mut self, what: &'static str, min_bytes: usize) -> Result<usize, BlobError> {
        let n = self.varint()?;
        let fits = (self.remaining() / min_bytes.max(1)) as u64;
        if n > fits {
            return Err(BlobError::Implausible {
                what,
                value: n,
                offset: self.pos,
            });
        }
        Ok(n as usize)
    }

    fn finish(self) -> Result<(), BlobError> {
        match self.remaining() {
            0 => Ok(()),
            extra => Err(BlobError::TrailingBytes { extra }),
        }
    }
}

fn decode_deltas(
    blob: &[u8],
    magic: u8,
    what: &'static str,
    max: i64,
) -> Result<Vec<i64>, BlobError> {
    let mut r = Reader::open(blob, magic)?;
    let n = r.count("element count", 1)?;
    let mut out = Vec::with_capacity(n);
    let mut prev = 0i64;
    for _ in 0..n {
        let d = unzigzag(r.varint()?);
        let v = prev.checked_add(d).filter(|v| (0..=max).contains(v));
        let v = v.ok_or(BlobError::Implausible {
            what,
            value: prev.wrapping_add(d) as u64,
            offset: r.pos,
        })?;
        out.push(v);
        prev = v;
    }
    r.finish()?;
    Ok(out)
}

/// Decodes a token-ID blob.
pub fn decode_tokens(blob: &[u8]) -> Result<Vec<u32>, BlobError> {
    let v = decode_deltas(blob, MAGIC_TOKENS, "token id", i64::from(u32::MAX))?;
    // Every value was range-checked against u32::MAX above.
    Ok(v.into_iter().map(|x| x as u32).collect())
}

/// Decodes a time-offset blob (microseconds).
pub fn decode_times(blob: &[u8]) -> Result<Vec<u64>, BlobError> {
    let v = decode_deltas(blob, MAGIC_TIMES, "time offset", i64::MAX)?;
    Ok(v.into_iter().map(|x| x as u64).collect())
}

/// Decodes a logits-summary blob.
pub fn decode_logits(blob: &[u8]) -> Result<Vec<LogitsSummary>, BlobError> {
    let mut r = Reader::open(blob, MAGIC_LOGITS)?;
    let n = r.count("entry count", 9)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let logprob = r.f32()?;
        let entropy = r.f32()?;
        let k = r.count("top-k count", 5)?;
        let mut top = Vec::with_capacity(k);
        for _ in 0..k {
            let id = r.varint()?;
            let id = u32::try_from(id).map_err(|_| BlobError::Implausible {
                what: "token id",
                value: id,
                offset: r.pos,
            })?;
            top.push((id, r.f32()?));
        }
        out.push(LogitsSummary {
            logprob,
            top,
            entropy,
        });
    }
    r.finish()?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn rng() -> rand::rngs::StdRng {
        rand::rngs::StdRng::seed_from_u64(0x7a9e_dec4)
    }

    #[test]
    fn tokens_round_trip_random() {
        let mut rng = rng();
        for _ in 0..300 {
            let n = rng.random_range(0..500);
            let ids: Vec<u32> = (0..n)
                .map(|_| match rng.random_range(0..4) {
                    0 => rng.random(),
                    1 => u32::MAX,
                    _ => rng.random_range(0..152_000),
                })
                .collect();
            let blob = encode_tokens(&ids);
            assert_eq!(decode_tokens(&blob).unwrap(), ids);
        }
        assert_eq!(
            decode_tokens(&encode_tokens(&[])).unwrap(),
            Vec::<u32>::new()
        );
    }

    #[test]
    fn times_round_trip_random_including_decreases() {
        let mut rng = rng();
        for _ in 0..300 {
            let n = rng.random_range(0..300);
            let mut t = 0u64;
            let times: Vec<u64> = (0..n)
                .map(|_| {
                    if rng.random_range(0..10) == 0 {
                        t = rng.random_range(0..(i64::MAX as u64));
                    } else {
                        t += rng.random_range(0..50_000);
                    }
                    t
                })
                .collect();
            assert_eq!(decode_times(&encode_times(&times)).unwrap(), times);
        }
    }

    #[test]
    fn logits_round_trip_random_bit_exact() {
        let mut rng = rng();
        for _ in 0..200 {
            let n = rng.random_range(0..100);
            let s: Vec<LogitsSummary> = (0..n)
                .map(|_| LogitsSummary {
                    logprob: f32::from_bits(rng.random()),
                    entropy: rng.random_range(0.0..12.0),
                    top: (0..rng.random_range(0..21))
                        .map(|_| (rng.random(), -rng.random_range(0.0f32..30.0)))
                        .collect(),
                })
                .collect();
            let back = decode_logits(&encode_logits(&s)).unwrap();
            assert_eq!(back.len(), s.len());
            for (a, b) in s.iter().zip(&back) {
                assert_eq!(a.logprob.to_bits(), b.logprob.to_bits());
                assert_eq!(a.entropy.to_bits(), b.entropy.to_bits());
                assert_eq!(a.top.len(), b.top.len());
                for (x, y) in a.top.iter().zip(&b.top) {
                    assert_eq!(x.0, y.0);
                    assert_eq!(x.1.to_bits(), y.1.to_bits());
                }
            }
        }
    }

    #[test]
    fn documented_example_is_exact() {
        // The example in recorder/FORMAT.md.
        let blob = encode_tokens(&[151_644, 151_645, 872]);
        assert_eq!(
            blob,
            [0x54, 0x01, 0x03, 0xb8, 0xc1, 0x12, 0x02, 0xe9, 0xb3, 0x12]
        );
    }

    #[test]
    fn sequential_ids_take_one_byte_each() {
        let ids: Vec<u32> = (150_000..151_000).collect();
        assert!(encode_tokens(&ids).len() < 1_000 + 8);
    }

    #[test]
    fn rejects_bad_header() {
        assert_eq!(decode_tokens(&[]), Err(BlobError::NoHeader { len: 0 }));
        assert_eq!(
            decode_tokens(&encode_logits(&[])),
            Err(BlobError::BadMagic {
                expected: MAGIC_TOKENS,
                found: MAGIC_LOGITS
            })
        );
        let mut b = encode_tokens(&[1, 2, 3]);
        b[1] = 2;
        assert_eq!(
            decode_tokens(&b),
            Err(BlobError::UnsupportedVersion { found: 2 })
        );
    }

    #[test]
    fn rejects_every_truncation_and_trailing_bytes() {
        let mut rng = rng();
        let s: Vec<LogitsSummary> = (0..5)
            .map(|i| LogitsSummary {
                logprob: -0.5,
                entropy: 1.0,
                top: (0..8).map(|j| (i * 1000 + j * 77_777, -1.0)).collect(),
            })
            .collect();
        let l = encode_logits(&s);
        let ids: Vec<u32> = (0..50).map(|_| rng.random()).collect();
        let t = encode_tokens(&ids);
        let m = encode_times(&[5, 1_000_000, 2_000_000_000]);
        for cut in 0..l.len() {
            assert!(decode_logits(&l[..cut]).is_err(), "cut {cut}");
        }
        for cut in 0..t.len() {
            assert!(decode_tokens(&t[..cut]).is_err(), "cut {cut}");
        }
        for cut in 0..m.len() {
            assert!(decode_times(&m[..cut]).is_err(), "cut {cut}");
        }
        let mut long = t.clone();
        long.push(0);
        assert_eq!(
            decode_tokens(&long),
            Err(BlobError::TrailingBytes { extra: 1 })
        );
    }

    #[test]
    fn rejects_huge_counts_without_allocating() {
        let mut b = vec![MAGIC_TOKENS, VERSION];
        put_varint(&mut b, 1 << 40);
        b.extend_from_slice(&[0, 0, 0]);
        assert!(matches!(
            decode_tokens(&b),
            Err(BlobError::Implausible { .. })
        ));
        let mut b = vec![MAGIC_TOKENS, VERSION, 1];
        b.extend_from_slice(&[0xff; 11]);
        assert!(matches!(
            decode_tokens(&b),
            Err(BlobError::BadVarint { .. })
        ));
        // An ID delta that leaves the u32 range.
        let mut b = vec![MAGIC_TOKENS, VERSION, 1];
        put_varint(&mut b, zigzag(-1));
        assert!(matches!(
            decode_tokens(&b),
            Err(BlobError::Implausible { .. })
        ));
    }

    #[test]
    fn random_garbage_never_panics() {
        let mut rng = rng();
        for _ in 0..5_000 {
            let n = rng.random_range(0..40);
            let mut b: Vec<u8> = (0..n).map(|_| rng.random()).collect();
            if n >= 2 && rng.random_bool(0.7) {
                b[0] = [MAGIC_TOKENS, MAGIC_TIMES, MAGIC_LOGITS][rng.random_range(0..3)];
                b[1] = VERSION;
            }
            let _ = decode_tokens(&b);
            let _ = decode_times(&b);
            let _ = decode_logits(&b);
        }
    }
}
