//! The index arrays one forward pass hands its kernels, and the token picks they hand back.
//!
//! Every per-token and per-sequence index a kernel reads (token IDs, positions, KV slots, block
//! tables, context lengths, which rows want logits, which rows take the decode kernel, which
//! tokens are picked on the device) is built on the host into one `i32` array and uploaded in one
//! copy. A captured CUDA graph bakes the array's *layout* (offsets, row counts, table widths) into
//! its launches, so a graph pass pads the batch to a fixed shape ([`Pad`]): padded rows write no
//! KV (slot -1), attend to one position of block 0 and are never read back.

use crate::generate::LogitsSummary;
use crate::model::{Logits, Pick, Segment, WantLogits};
use crate::models::llama::chunk_boundary_hidden;
use crate::toggles::{AttnPrefill, Toggles};

/// Host-side index arrays of one pass, uploaded in one copy. Offsets are in i32 elements.
pub(super) struct Meta {
    pub data: Vec<i32>,
    /// Rows computed: the batch's tokens, plus padding in a graph pass.
    pub rows: usize,
    pub ids: usize,
    pub pos: usize,
    pub slots: usize,
    pub seg: usize,
    pub ctx: usize,
    pub hide: usize,
    pub tables: usize,
    pub max_blocks: usize,
    /// Rows whose logits are wanted, as token indices.
    pub logit_rows: usize,
    pub n_logit_rows: usize,
    /// Decode tokens (for the sparse top-k path and the bf16 decode kernel).
    pub decode_rows: usize,
    pub n_decode_rows: usize,
    /// The rows the plain f32 path serves (all of them, or those that are not decode rows when
    /// the decode rows have their own kernel), split in two: tiles of prompt-chunk tokens for the
    /// tiled prefill kernel (`(first token, count)` pairs, longest context first), and the rest
    /// (one-token segments, padded rows) for the SIMT kernel.
    pub tiles: usize,
    pub n_tiles: usize,
    pub simt_rows: usize,
    pub n_simt_rows: usize,
    /// Per decode row: its block table (`max_blocks` each) and context length (the per-token
    /// arrays themselves when every row is a one-token decode segment, as in a graph pass).
    pub decode_tables: usize,
    pub decode_ctx: usize,
    /// Rows picked on the device: their logit row (index into the logits buffer) and the token
    /// to report (-1: the most likely), `n_picks` each; `pick_k` is the largest number of
    /// alternatives any of them keeps (at least 1).
    pub pick_rows: usize,
    pub pick_chosen: usize,
    pub n_picks: usize,
    pub pick_k: usize,
    /// Per segment: which pick result is its own (`None`: its rows are copied back whole).
    pub pick_slot: Vec<Option<usize>>,
}

/// The fixed shape a graph pass pads its batch to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Pad {
    /// Rows (one-token decode segments), at least the batch's.
    pub rows: usize,
    /// Block-table width, at least the longest table's.
    pub max_blocks: usize,
}

/// Alternatives the device keeps per picked row (`PICK_MAX_K` in kernels/engine.cu).
pub(super) const PICK_MAX_K: usize = 32;
/// Logits per partial reduction, and the most partials one row may have (`PICK_CHUNK`,
/// `PICK_MAX_CHUNKS`): vocabularies up to 256k tokens are picked on the device. Small chunks
/// spread a row over many blocks (63 for Llama's 128k vocabulary): the per-chunk work (f64 sums,
/// k rounds of warp-wide maxima) is latency-bound, and 16 blocks of 8192 took 11.4 µs.
pub(super) const PICK_CHUNK: usize = 2048;
const PICK_MAX_CHUNKS: usize = 128;

/// Which word of a picked row's result is the token (`parse_pick`); `embed_tokens` reads it
/// there for a fed id.
pub(super) const FED_WORD: usize = 4;

/// The id that makes `embed_tokens` (kernels/engine.cu) read the token the previous pass picked
/// instead: never a vocabulary id.
pub(super) const FED_TOKEN: u32 = u32::MAX;

/// u32 words of one picked row's result (`PICK_WORDS` in kernels/engine.cu).
pub(super) fn pick_words(k: usize) -> usize {
    6 + 2 * k
}

/// Whether the device can make this pick for a vocabulary of `vocab` (otherwise the row is
/// copied back and picked on the host, with the same result).
pub(super) fn device_pick(want: WantLogits, vocab: usize) -> Option<Pick> {
    match want {
        WantLogits::Pick(p)
            if p.k <= PICK_MAX_K && vocab.div_ceil(PICK_CHUNK) <= PICK_MAX_CHUNKS =>
        {
            Some(p)
        }
        _ => None,
    }
}

/// The pick of one row from the words `pick_finish` wrote: the summary `summarize` would give
/// from the same logits.
pub(super) fn parse_pick(words: &[u32], k: usize) -> Logits {
    let f64_at = |i: usize| f64::from_bits(u64::from(words[i]) | (u64::from(words[i + 1]) << 32));
    let (lse, entropy) = (f64_at(0), f64_at(2));
    let token = words[FED_WORD];
    let logprob = f32::from_bits(words[5]) as f64 - lse;
    let top = (0..k)
        .map(|r| (words[6 + 2 * r], f32::from_bits(words[7 + 2 * r])))
        .filter(|&(id, _)| id != u32::MAX)
        .map(|(id, v)| (id, (v as f64 - lse) as f32))
        .collect();
    Logits::Picked {
        token,
        summary: LogitsSummary {
            logprob: logprob as f32,
            top,
            entropy: entropy as f32,
        },
    }
}

/// Builds the pass's index arrays. `where_` is each token's (segment, position); `pad` pads to a
/// graph's shape (every segment must then be a one-token decode step wanting its logits);
/// `tile_tokens` is how many tokens one prefill tile takes (`None`: no tiled kernel for this
/// model's heads).
#[allow(clippy::too_many_arguments)]
pub(super) fn build_meta(
    segs: &[Segment<'_>],
    where_: &[(usize, usize)],
    block_size: usize,
    vocab: usize,
    toggles: &Toggles,
    pad: Option<Pad>,
    tile_tokens: Option<usize>,
) -> Meta {
    let n = where_.len();
    let longest = segs
        .iter()
        .map(|s| s.table.blocks.len())
        .max()
        .unwrap_or(0)
        .max(1);
    let max_blocks = pad.map_or(longest, |p| p.max_blocks.max(longest));
    let rows = pad.map_or(n, |p| p.rows.max(n));
    let extra = rows - n;
    let mut data = Vec::with_capacity(8 * rows + (segs.len() + extra) * max_blocks);
    let section = |data: &mut Vec<i32>, real: &mut dyn Iterator<Item = i32>, fill: i32| {
        let at = data.len();
        data.extend(real);
        data.extend(std::iter::repeat_n(fill, extra));
        at
    };
    let ids = section(
        &mut data,
        &mut segs.iter().flat_map(|s| s.tokens.iter().map(|&t| t as i32)),
        0,
    );
    let pos = section(&mut data, &mut where_.iter().map(|&(_, p)| p as i32), 0);
    let slots = section(
        &mut data,
        &mut where_
            .iter()
            .map(|&(si, p)| segs[si].table.slot(p, block_size) as i32),
        -1,
    );
    // Padded rows are segments of their own, past the real ones, with all-zero tables.
    let seg = data.len();
    data.extend(where_.iter().map(|&(si, _)| si as i32));
    data.extend((0..extra).map(|i| (segs.len() + i) as i32));
    let ctx = section(&mut data, &mut where_.iter().map(|&(_, p)| p as i32 + 1), 1);
    let hide = section(
        &mut data,
        &mut where_.iter().map(|&(si, p)| {
            let s = &segs[si];
            chunk_boundary_hidden(s.fault_chunk_boundary, s.table.len, p).map_or(-1, |h| h as i32)
        }),
        -1,
    );
    // A block table as one row of `max_blocks` entries, padded with block 0 (never read).
    let push_table = |data: &mut Vec<i32>, blocks: &[u32]| {
        data.extend(blocks.iter().map(|&b| b as i32));
        data.extend(std::iter::repeat_n(0, max_blocks - blocks.len()));
    };
    let tables = data.len();
    for s in segs {
        push_table(&mut data, &s.table.blocks);
    }
    for _ in 0..extra {
        push_table(&mut data, &[]);
    }
    let logit_rows = data.len();
    let mut t0 = 0usize;
    for s in segs {
        data.extend(s.logit_rows().map(|r| (t0 + r) as i32));
        t0 += s.tokens.len();
    }
    data.extend((n..rows).map(|t| t as i32));
    let n_logit_rows = data.len() - logit_rows;
    // Decode rows get their own kernel exactly when decode differs from prefill.
    let decode_rows = data.len();
    if !toggles.decode_matches_prefill() {
        data.extend(
            where_
                .iter()
                .enumerate()
                .filter(|(_, &(si, _))| segs[si].decode)
                .map(|(t, _)| t as i32),
        );
        if data.len() > decode_rows {
            data.extend((n..rows).map(|t| t as i32));
        }
    }
    let n_decode_rows = data.len() - decode_rows;
    // The plain path's rows: tiles of multi-token segments, the rest one by one.
    let decode_own = n_decode_rows > 0;
    let (mut tile_list, mut simt) = (Vec::new(), Vec::new());
    let mut t0 = 0usize;
    for s in segs {
        let len = s.tokens.len();
        if !(decode_own && s.decode) {
            match tile_tokens {
                // One-token prompt chunks too with the tensor-core kernel: `attention` rounds
                // p against the final max, so a chunk boundary would change the bits.
                Some(per) if len > 1 || toggles.attn_prefill == AttnPrefill::MmaBf16 => {
                    for j in (0..len).step_by(per) {
                        let count = per.min(len - j);
                        // (largest context in the tile, first token, count)
                        tile_list.push((s.table.len + j + count, t0 + j, count));
                    }
                }
                _ => simt.extend((t0..t0 + len).map(|t| t as i32)),
            }
        }
        t0 += len;
    }
    if !decode_own {
        simt.extend((n..rows).map(|t| t as i32));
    }
    tile_list.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    let tiles = data.len();
    for &(_, first, count) in &tile_list {
        data.extend([first as i32, count as i32]);
    }
    let simt_rows = data.len();
    data.extend(&simt);
    // Every row a one-token decode segment, in order: the decode tables are the tables.
    let (decode_tables, decode_ctx) = if n_decode_rows == rows && segs.len() == n {
        (tables, ctx)
    } else {
        let dec: Vec<usize> = data[decode_rows..decode_rows + n_decode_rows]
            .iter()
            .map(|&t| t as usize)
            .collect();
        let decode_tables = data.len();
        for &t in &dec {
            push_table(&mut data, &segs[where_[t].0].table.blocks);
        }
        let decode_ctx = data.len();
        data.extend(dec.iter().map(|&t| where_[t].1 as i32 + 1));
        (decode_tables, decode_ctx)
    };
    // Picks: a graph pass picks every row (its launches are fixed), the others only the
    // segments that asked for a pick the device can make.
    let (mut pick_row, mut chosen, mut pick_slot, mut pick_k, mut row) =
        (Vec::new(), Vec::new(), Vec::new(), 1, 0usize);
    for s in segs {
        let p = device_pick(s.want, vocab);
        if p.is_some() || pad.is_some() {
            pick_slot.push(p.map(|_| pick_row.len()));
            pick_row.push(row as i32);
            chosen.push(p.and_then(|p| p.token).map_or(-1, |t| t as i32));
            pick_k = pick_k.max(p.map_or(0, |p| p.k));
        } else {
            pick_slot.push(None);
        }
        row += s.logit_rows().len();
    }
    if pad.is_some() {
        pick_row.extend((n..rows).map(|t| t as i32));
        chosen.extend(std::iter::repeat_n(-1, extra));
    }
    let pick_rows = data.len();
    data.extend(&pick_row);
    let pick_chosen = data.len();
    data.extend(&chosen);
    Meta {
        data,
        rows,
        ids,
        pos,
        slots,
        seg,
        ctx,
        hide,
        tables,
        max_blocks,
        logit_rows,
        n_logit_rows,
        decode_rows,
        n_decode_rows,
        tiles,
        n_tiles: tile_list.len(),
        simt_rows,
        n_simt_rows: simt.len(),
        decode_tables,
        decode_ctx,
        pick_rows,
        pick_chosen,
        n_picks: pick_row.len(),
        pick_k,
        pick_slot,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::BlockTable;

    #[test]
    fn meta_lists_logit_rows_decode_rows_and_hidden_positions() {
        let mut t1 = BlockTable {
            blocks: vec![5, 2],
            len: 16,
        };
        let mut t2 = BlockTable {
            blocks: vec![7],
            len: 3,
        };
        let (a, b) = ([1u32, 2, 3], [9u32]);
        let segs = [
            Segment {
                tokens: &a,
                table: &mut t1,
                decode: false,
                want: WantLogits::All,
                fault_chunk_boundary: true,
            },
            Segment {
                tokens: &b,
                table: &mut t2,
                decode: true,
                want: WantLogits::Pick(Pick {
                    k: 5,
                    token: Some(4),
                }),
                fault_chunk_boundary: false,
            },
        ];
        let where_ = [(0, 16), (0, 17), (0, 18), (1, 3)];
        let toggles: Toggles = "attn_decode=mma-bf16".parse().unwrap();
        let m = build_meta(&segs, &where_, 16, 1000, &toggles, None, Some(2));
        let d = &m.data;
        assert_eq!(&d[m.ids..m.ids + 4], &[1, 2, 3, 9]);
        // Position 16 of the first sequence is slot 0 of block 2; position 3 of the second is
        // slot 3 of block 7.
        assert_eq!(&d[m.slots..m.slots + 4], &[32, 33, 34, 115]);
        assert_eq!(&d[m.ctx..m.ctx + 4], &[17, 18, 19, 4]);
        // The chunk-boundary fault hides position 15 from the chunk's first token only.
        assert_eq!(&d[m.hide..m.hide + 4], &[15, -1, -1, -1]);
        assert_eq!(m.max_blocks, 2);
        assert_eq!(&d[m.tables..m.tables + 4], &[5, 2, 7, 0]);
        assert_eq!(
            &d[m.logit_rows..m.logit_rows + m.n_logit_rows],
            &[0, 1, 2, 3]
        );
        assert_eq!(&d[m.decode_rows..m.decode_rows + m.n_decode_rows], &[3]);
        // The prompt chunk's three tokens go to the tiled kernel in tiles of two, the one with
        // the longer context (tokens 2.., context 19) first.
        assert_eq!(&d[m.tiles..m.tiles + 2 * m.n_tiles], &[2, 1, 0, 2]);
        assert_eq!(m.n_simt_rows, 0);
        assert_eq!(&d[m.decode_tables..m.decode_tables + 2], &[7, 0]);
        assert_eq!(d[m.decode_ctx], 4);
        // The second segment's token is picked on the device: its logit row is the fourth.
        assert_eq!((m.n_picks, m.pick_k), (1, 5));
        assert_eq!((d[m.pick_rows], d[m.pick_chosen]), (3, 4));
        assert_eq!(m.pick_slot, vec![None, Some(0)]);
    }

    #[test]
    fn a_padded_graph_pass_has_a_fixed_layout_and_inert_rows() {
        let mut tables: Vec<BlockTable> = [vec![3u32], vec![1, 4]]
            .into_iter()
            .map(|blocks| BlockTable { blocks, len: 10 })
            .collect();
        let toks = [[11u32], [12u32]];
        let segs: Vec<Segment> = tables
            .iter_mut()
            .zip(&toks)
            .enumerate()
            .map(|(i, (table, t))| Segment {
                tokens: t,
                table,
                decode: true,
                want: if i == 0 {
                    WantLogits::Pick(Pick { k: 3, token: None })
                } else {
                    WantLogits::Last
                },
                fault_chunk_boundary: false,
            })
            .collect();
        let where_ = [(0, 10), (1, 10)];
        let toggles: Toggles = "attn_decode=mma-bf16".parse().unwrap();
        let pad = Pad {
            rows: 4,
            max_blocks: 4,
        };
        let m = build_meta(&segs, &where_, 16, 1000, &toggles, Some(pad), Some(8));
        let d = &m.data;
        assert_eq!((m.rows, m.max_blocks), (4, 4));
        assert_eq!(&d[m.ids..m.ids + 4], &[11, 12, 0, 0]);
        // Padded rows write no KV and see one position.
        assert_eq!(&d[m.slots..m.slots + 4], &[58, 26, -1, -1]);
        assert_eq!(&d[m.ctx..m.ctx + 4], &[11, 11, 1, 1]);
        assert_eq!(&d[m.seg..m.seg + 4], &[0, 1, 2, 3]);
        assert_eq!(
            &d[m.tables..m.tables + 16],
            &[3, 0, 0, 0, 1, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
        );
        assert_eq!(m.n_logit_rows, 4);
        assert_eq!(m.n_decode_rows, 4);
        assert_eq!((m.decode_tables, m.decode_ctx), (m.tables, m.ctx));
        assert_eq!((m.n_tiles, m.n_simt_rows), (0, 0));
        // Every row is picked (fixed launches); only the first segment reads its pick.
        assert_eq!((m.n_picks, m.pick_k), (4, 3));
        assert_eq!(&d[m.pick_chosen..m.pick_chosen + 4], &[-1, -1, -1, -1]);
        assert_eq!(m.pick_slot, vec![Some(0), None]);
        // The layout depends on the pad only, not on the batch's contents.
        let fewer = build_meta(
            &segs[..1],
            &where_[..1],
            16,
            1000,
            &toggles,
            Some(pad),
            Some(8),
        );
        assert_eq!(
            (
                fewer.data.len(),
                fewer.tables,
                fewer.pick_rows,
                fewer.decode_rows
            ),
            (m.data.len(), m.tables, m.pick_rows, m.decode_rows)
        );
    }

    #[test]
    fn picks_parse_as_the_host_summary_reads() {
        let lse = 2.5f64;
        let mut w = vec![0u32; pick_words(3)];
        w[..2].copy_from_slice(&[lse.to_bits() as u32, (lse.to_bits() >> 32) as u32]);
        let ent = 1.25f64;
        w[2..4].copy_from_slice(&[ent.to_bits() as u32, (ent.to_bits() >> 32) as u32]);
        w[4] = 7;
        w[5] = 2.0f32.to_bits();
        w[6..].copy_from_slice(&[7, 2.0f32.to_bits(), 3, 1.0f32.to_bits(), u32::MAX, 0]);
        let Logits::Picked { token, summary } = parse_pick(&w, 3) else {
            panic!()
        };
        assert_eq!(token, 7);
        assert!((summary.logprob - (2.0 - 2.5)).abs() < 1e-7);
        assert_eq!(summary.entropy, 1.25);
        // The third alternative lies past the vocabulary: dropped.
        assert_eq!(summary.top, vec![(7, -0.5), (3, -1.5)]);
    }
}
