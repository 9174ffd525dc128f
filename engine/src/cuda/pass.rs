//! One forward pass on the GPU: its indices built and uploaded ([`Pass`], `Inner::prepare`), its
//! launches recorded on the stream (`Inner::record`, the token picks after them), captured and
//! replayed as a CUDA graph (`Inner::replay`), and what it computed copied back
//! (`Inner::collect`).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use cudarc::driver::result as dr;
use cudarc::driver::CudaContext;

use super::host::{Laps, Part};
use super::launch::Args;
use super::linears::{
    bias, gemv_splits, mlp_flow_splits, DevLinear, EmbedGather, GemvIn, MergedSplits, MlpFlow,
    RopeArgs, FUSED_MERGE_MAX_SPLITS, GEMV_MAX_ROWS, GEMV_NORM_SMEM, GEMV_WARPS,
    MLP_FLOW_GROUPS_AT,
};
use super::memory::{ensure, ensure_zeroed, DeviceKv, KvElem};
use super::meta::{
    build_meta, device_pick, parse_pick, pick_words, Meta, Pad, FED_WORD, PICK_CHUNK,
};
use super::{
    dev_err, kernels, kv_key, split_rule, step, tune, Graph, GraphKey, Inner, CLUSTER_MERGES,
    FUSED_MERGE, FUSED_MLP, FUSED_ROPE, GRAPH_CACHE,
};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::model::{Logits, Segment, WantLogits};
use crate::toggles::{AttnDecode, AttnPrefill, KvDtype, Pdl, Precision, SmallGemm, Toggles};

/// Most splits one thread block cluster of the mma decode kernel takes (the portable cluster
/// size).
const MMA_CLUSTER_MAX: usize = 8;

/// The first `bytes` of a linear layer's bf16 weights (all of them at most), as an L2 prefetch
/// range: its first rows, which the first blocks of its GEMV read.
pub(super) fn prefix(l: &DevLinear, bytes: usize) -> (u64, usize) {
    (l.w_bf16.ptr, bytes.min(l.out * l.inp * 2))
}

/// Everything one pass's launches read, fixed before the first of them: a captured graph
/// replays exactly these addresses and shapes.
pub(super) struct Pass {
    pub(super) meta: Meta,
    pub(super) meta_ptr: u64,
    pub(super) block_size: usize,
    pub(super) matmul: Precision,
    pub(super) scale: f32,
    pub(super) kv_mode: usize,
    /// Attention rounds to bf16 in prefill rows / in decode rows.
    pub(super) attn_bf16: usize,
    pub(super) decode_bf16: usize,
    /// Prompt tiles go through the tensor-core prefill kernel (`attn_prefill=mma-bf16`, where
    /// the head_dim has one); the tile list was cut for it.
    pub(super) prefill_mma: bool,
    /// `decode_topk`: the selection size, its scores buffer and row stride.
    pub(super) topk: Option<(usize, u64, usize)>,
    /// The mma decode kernel's buffers and split geometry.
    pub(super) mma: Option<MmaPass>,
    /// How the linear layers run.
    pub(super) linears: Linears,
    /// The GEMV kernels are launched with programmatic dependent launch (`pdl=on` or `all`).
    pub(super) pdl: bool,
    /// So are the other kernels of a decode step (`pdl=all`): RoPE + KV write, the mma decode
    /// kernel and its merge, the final RMSNorm and the picks.
    pub(super) pdl_all: bool,
    /// Kernel fusions on the GEMV path (`fuse=on`, those `TAPEDECK_FUSE` selects): RoPE + KV
    /// write in the q/k/v GEMV, the split merge in the o GEMV, the final norm in the head (each
    /// where its conditions hold, see `record`).
    pub(super) fuse: tune::Fusions,
    /// The MLP as one dataflow grid (the `mlp` fusion, where the shape allows): its buffers.
    pub(super) mlp_flow: Option<MlpFlow>,
    /// The logit rows are the pass's rows in order: the head reads the hidden states in place.
    pub(super) logits_in_place: bool,
    pub(super) logits: u64,
    /// Token picking: statistics, candidates, results; chunks per row.
    pub(super) pick: Option<(u64, u64, u64, usize)>,
    /// The whole step as one persistent kernel (`megakernel=on`, when it applies): its argument
    /// and dynamic shared memory.
    pub(super) mega: Option<(step::MkParams, usize)>,
}

/// The mma decode kernel's buffers. When every row is a decode row, in order, `q_dec` and
/// `o_dec` are the pass's own query and attention-output buffers (`gather` false); otherwise the
/// decode rows are gathered into them and scattered back.
/// How a pass runs its linear layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Linears {
    /// cuBLAS GEMMs, with RMSNorm, SiLU·up and residual adds as kernels of their own.
    Cublas,
    /// The GEMV kernels (`small_gemm=gemv`, `matmul=bf16`, few rows), the RMSNorm before q/k/v
    /// and gate/up still its own launch (the rows do not fit the fused norm's shared memory).
    Gemv,
    /// The GEMV kernels with the RMSNorm fused in.
    GemvFusedNorm,
}

pub(super) struct MmaPass {
    pub(super) q_dec: u64,
    pub(super) o_dec: u64,
    pub(super) gather: bool,
    pub(super) partial_out: u64,
    pub(super) partial_ml: u64,
    pub(super) split_len: usize,
    pub(super) max_splits: usize,
    /// The split counters, (rows, KV heads) zeroed words, when the mma kernel merges its own
    /// splits (`TAPEDECK_MMA_MERGE=in-kernel`); else 0 and the combine kernel runs.
    pub(super) done: u64,
    /// The splits run as thread block clusters that merge them (`TAPEDECK_MMA_MERGE=cluster`,
    /// where the GPU has clusters and there are 2 to 8 splits): no combine launch.
    pub(super) cluster: bool,
}

impl Inner {
    /// Builds the pass's indices and makes sure every buffer it needs exists.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn prepare(
        &mut self,
        ctx: &Arc<CudaContext>,
        cfg: &Config,
        segs: &[Segment<'_>],
        where_: &[(usize, usize)],
        bs: usize,
        toggles: &Toggles,
        pad: Option<Pad>,
        kv: &DeviceKv,
    ) -> Result<Pass> {
        // Tokens per prefill tile: the tiled kernel that will run decides.
        let pk = self.gpu.k.pool(kv.elem);
        let prefill_mma = toggles.attn_prefill == AttnPrefill::MmaBf16 && pk.prefill_mma.is_some();
        let tile_rows = if prefill_mma {
            Some(kernels::prefill_mma_rows(cfg.head_dim))
        } else {
            pk.prefill.as_ref().map(|_| kernels::PREFILL_ROWS)
        };
        let tile_tokens = tile_rows
            .map(|rows| rows / (cfg.num_heads / cfg.num_kv_heads))
            .filter(|&t| t > 0);
        let meta = build_meta(segs, where_, bs, cfg.vocab_size, toggles, pad, tile_tokens);
        let rows = meta.rows;
        self.ensure_scratch(ctx, cfg, rows)?;
        let (hd, nh, nkv) = (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads);
        let q_dim = nh * hd;
        let sms = self.gpu.sms;
        let linears = if toggles.small_gemm == SmallGemm::Gemv
            && toggles.matmul == Precision::Bf16
            && rows <= GEMV_MAX_ROWS
            && self.gemv_fits
        {
            if rows * cfg.hidden_size * 2 <= GEMV_NORM_SMEM {
                Linears::GemvFusedNorm
            } else {
                Linears::Gemv
            }
        } else {
            Linears::Cublas
        };
        let sc = &mut self.scratch;
        let (q_buf, att_buf) = match &sc.bufs {
            Some(b) => (b.q.ptr, b.att.ptr),
            None => return Err(Error::Device("scratch buffers missing".into())),
        };
        let in_order = |at: usize, count: usize| {
            count == rows && meta.data[at..at + count].iter().copied().eq(0..rows as i32)
        };
        let decode_in_order = in_order(meta.decode_rows, meta.n_decode_rows);
        let logits_in_place = in_order(meta.logit_rows, meta.n_logit_rows);
        let g = &mut sc.generation;
        let meta_ptr = ensure(&mut sc.meta, ctx, meta.data.len() * 4, g)?;
        // The longest context a decode row may have: the real one, or the graph's capacity.
        let decode_ctx = &meta.data[meta.decode_ctx..meta.decode_ctx + meta.n_decode_rows];
        let max_len = match pad {
            Some(p) => p.max_blocks * bs,
            None => decode_ctx.iter().map(|&c| c as usize).max().unwrap_or(1),
        };
        let nr = meta.n_decode_rows;
        let topk = match (toggles.decode_topk, nr) {
            (Some(k), 1..) => {
                let stride = max_len.max(1);
                let scores = ensure(&mut sc.scores, ctx, nr * nh * stride * 4, g)?;
                Some((k.get(), scores, stride))
            }
            _ => None,
        };
        let mma_shape_ok = matches!(hd, 64 | 128) && nh / nkv <= 16 && bs.is_multiple_of(16);
        let mma = if toggles.attn_decode == AttnDecode::MmaBf16
            && topk.is_none()
            && mma_shape_ok
            && nr > 0
        {
            let (split_len, max_splits) = split_rule(nr, nkv, max_len, sms, tune::get().split_min);
            let (q_dec, o_dec) = if decode_in_order {
                (q_buf, att_buf)
            } else {
                (
                    ensure(&mut sc.q_dec, ctx, nr * q_dim * 4, g)?,
                    ensure(&mut sc.o_dec, ctx, nr * q_dim * 4, g)?,
                )
            };
            Some(MmaPass {
                q_dec,
                o_dec,
                gather: !decode_in_order,
                partial_out: ensure(&mut sc.partial_out, ctx, nr * nh * max_splits * hd * 4, g)?,
                partial_ml: ensure(&mut sc.partial_ml, ctx, nr * nh * max_splits * 2 * 4, g)?,
                split_len,
                max_splits,
                done: if tune::get().mma_merge == tune::MmaMerge::InKernel {
                    ensure_zeroed(&mut sc.mma_done, ctx, nr * nkv * 4, g)?
                } else {
                    0
                },
                cluster: tune::get().mma_merge == tune::MmaMerge::Cluster
                    && self.gpu.pdl_capable
                    && (2..=MMA_CLUSTER_MAX).contains(&max_splits),
            })
        } else {
            None
        };
        let vocab = cfg.vocab_size;
        let r = meta.n_logit_rows;
        let logits = if r > 0 {
            ensure(&mut sc.logits, ctx, r * vocab * 4, g)?
        } else {
            0
        };
        let pick = if meta.n_picks > 0 {
            let (p, k, chunks) = (meta.n_picks, meta.pick_k, vocab.div_ceil(PICK_CHUNK));
            Some((
                ensure(&mut sc.pick_stats, ctx, p * chunks * 3 * 8, g)?,
                ensure(&mut sc.pick_top, ctx, p * chunks * k * 8, g)?,
                ensure(&mut sc.pick_out, ctx, p * pick_words(k) * 4, g)?,
                chunks,
            ))
        } else {
            None
        };
        let kv_mode: usize = match toggles.kv_dtype {
            KvDtype::F32 => 0,
            KvDtype::Bf16 => 1,
            KvDtype::Fp8E4m3 => 2,
        };
        let mega_applies = toggles.megakernel
            && linears == Linears::GemvFusedNorm
            && rows == 1
            && nr == 1
            && logits_in_place
            && meta.n_logit_rows == 1
            && meta.n_simt_rows == 0
            && meta.n_tiles == 0
            && kv.elem != KvElem::Fp8
            && matches!(hd, 64 | 128);
        let mega = match (&mma, mega_applies) {
            (Some(m), true) if !m.gather => {
                let smem = kernels::DECODE_MMA_SMEM.max(cfg.hidden_size * 2);
                let mk = match &mut self.mega {
                    Some(mk) => mk,
                    slot => {
                        let trace = self.gpu.trace.as_ref().map(|t| (t, &self.gpu.stream));
                        let mk =
                            step::Megakernel::load(ctx, &self.gpu.arch, sms, smem, nkv, trace)?;
                        slot.insert(mk)
                    }
                };
                let (table, rebuilt) = mk.table(ctx, &self.layers, kv, kv_key(kv))?;
                if rebuilt {
                    // Graphs captured with the old table must never run again.
                    self.scratch.generation += 1;
                }
                let q_scr = ensure(
                    &mut self.scratch.mk_q,
                    ctx,
                    m.max_splits * q_dim * 4,
                    &mut self.scratch.generation,
                )?;
                let (bar, done) = mk.state();
                let b = self
                    .scratch
                    .bufs
                    .as_ref()
                    .ok_or_else(|| Error::Device("scratch buffers missing".into()))?;
                let mi = |off: usize| meta_ptr + (off * 4) as u64;
                let int = |v: usize| v as i32;
                let slice = tune::get().gemv_slice;
                Some((
                    step::MkParams {
                        x: b.x.ptr,
                        q: b.q.ptr,
                        k: b.k.ptr,
                        v: b.v.ptr,
                        att: b.att.ptr,
                        act: b.act.ptr,
                        logits,
                        layers: table,
                        bar,
                        done,
                        q_scr,
                        head_w: self.head.w_bf16.ptr,
                        head_b: bias(&self.head),
                        final_norm: self.norm.ptr,
                        inv_freq: self.inv_freq.ptr,
                        pos: mi(meta.pos),
                        slots: mi(meta.slots),
                        tables: mi(meta.decode_tables),
                        ctx: mi(meta.decode_ctx),
                        partial_out: m.partial_out,
                        partial_ml: m.partial_ml,
                        n_layers: int(self.layers.len()),
                        hidden: int(cfg.hidden_size),
                        inter: int(cfg.intermediate_size),
                        heads: int(nh),
                        kv_heads: int(nkv),
                        head_dim: int(hd),
                        vocab: int(vocab),
                        block_size: int(bs),
                        max_blocks: int(meta.max_blocks),
                        split_len: int(m.split_len),
                        max_splits: int(m.max_splits),
                        kv_mode: int(kv_mode),
                        splits_qkv: int(gemv_splits(cfg.hidden_size, 1, slice)),
                        splits_o: int(gemv_splits(q_dim, 1, slice)),
                        splits_down: int(gemv_splits(cfg.intermediate_size, 1, slice)),
                        splits_head: int(gemv_splits(cfg.hidden_size, 1, slice)),
                        eps: cfg.rms_norm_eps,
                        scale: 1.0 / (hd as f32).sqrt(),
                    },
                    smem,
                ))
            }
            _ => None,
        };
        let fuse = if toggles.fuse && linears != Linears::Cublas {
            tune::get().fuse
        } else {
            tune::Fusions::NONE
        };
        let (hidden, layers) = (cfg.hidden_size, self.layers.len());
        let mlp_flow = match mlp_flow_splits(hidden, cfg.intermediate_size, rows) {
            Some(splits) if fuse.mlp => {
                let sc = &mut self.scratch;
                let g = &mut sc.generation;
                // One set of counters per layer, each on its own 128-byte lines.
                let stride = (MLP_FLOW_GROUPS_AT + hidden / GEMV_WARPS).next_multiple_of(32);
                Some(MlpFlow {
                    counters: ensure_zeroed(&mut sc.mlp_counters, ctx, layers * stride * 4, g)?,
                    stride,
                    partial: ensure(&mut sc.mlp_partial, ctx, splits * rows * hidden * 4, g)?,
                    splits,
                })
            }
            _ => None,
        };
        Ok(Pass {
            mega,
            mlp_flow,
            meta,
            meta_ptr,
            block_size: bs,
            matmul: toggles.matmul,
            scale: 1.0 / (hd as f32).sqrt(),
            kv_mode,
            attn_bf16: usize::from(toggles.attention_bf16(false)),
            decode_bf16: usize::from(toggles.attention_bf16(true)),
            prefill_mma,
            topk,
            mma,
            linears,
            pdl: toggles.pdl != Pdl::Off,
            pdl_all: toggles.pdl == Pdl::All && self.gpu.pdl_capable,
            fuse,
            logits_in_place,
            logits,
            pick,
        })
    }

    /// Runs a graph pass: replays the graph captured for this shape, capturing it first when
    /// there is none (captured work does not run, so the first replay is the computation).
    pub(super) fn replay(
        &mut self,
        cfg: &Config,
        kv: &DeviceKv,
        pass: &Pass,
        pad: Pad,
        toggles: &Toggles,
    ) -> Result<()> {
        let key = GraphKey {
            pad,
            toggles: *toggles,
            pick_k: pass.meta.pick_k,
            kv: kv_key(kv),
            generation: self.scratch.generation,
        };
        if !self.graphs.contains_key(&key) {
            // Graphs of older buffers can never match again.
            let generation = self.scratch.generation;
            self.graphs.retain(|k, _| k.generation == generation);
            if self.graphs.len() >= GRAPH_CACHE {
                self.graphs.clear();
            }
            use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
            self.gpu
                .stream
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(|e| dev_err("starting a CUDA graph capture", e))?;
            let recorded = self.record(cfg, kv, pass);
            // End the capture whatever happened, so the stream is usable again.
            let graph = self.gpu.stream.end_capture(CUgraphInstantiate_flags(0));
            recorded?;
            let graph = graph
                .map_err(|e| dev_err("capturing a decode step as a CUDA graph", e))?
                .ok_or_else(|| Error::Device("a CUDA graph capture recorded nothing".into()))?;
            self.graphs.insert(key, Graph(graph));
        }
        self.graphs
            .get(&key)
            .ok_or_else(|| Error::Device("a captured CUDA graph went missing".into()))?
            .0
            .launch()
            .map_err(|e| dev_err("launching a CUDA graph", e))
    }

    /// Launches the whole pass on the stream: embedding, layers, final norm, head, picks. Nothing
    /// here copies to or from the host, allocates or synchronizes, so it can be captured.
    pub(super) fn record(&self, cfg: &Config, kv: &DeviceKv, pass: &Pass) -> Result<()> {
        let meta = &pass.meta;
        let n = meta.rows;
        let mi = |off: usize| pass.meta_ptr + (off * 4) as u64;
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let (nh, nkv) = (cfg.num_heads, cfg.num_kv_heads);
        let (q_dim, inter) = (nh * hd, cfg.intermediate_size);
        let (bs, pm) = (pass.block_size, pass.matmul);
        let Some(b) = self.scratch.bufs.as_ref() else {
            return Err(Error::Device("scratch buffers missing".into()));
        };
        let (x, xn, q, k, v, att, tmp, g, u, xb, act) = (
            b.x.ptr, b.xn.ptr, b.q.ptr, b.k.ptr, b.v.ptr, b.att.ptr, b.tmp.ptr, b.g.ptr, b.u.ptr,
            b.xb.ptr, b.act.ptr,
        );
        let s = &self.gpu.stream;
        let kn = &self.gpu.k;
        let pk = kn.pool(kv.elem);
        let elementwise = (n * h).div_ceil(256);
        // A fed id reads the token the previous pass picked into this pass's pick buffer (the
        // run-ahead decode, `CudaBackend::submit`).
        let fed = pass
            .pick
            .map_or(0, |(_, _, out, _)| out + FED_WORD as u64 * 4);
        // FP8 KV scales each head by its amax: that mode keeps the separate RoPE + KV kernel.
        let rope_fused = pass.fuse.rope && pass.kv_mode <= 1;
        // TAPEDECK_EMBED_FUSED: the first q/k/v launch of a one-row step gathers the embedding.
        let embed_gather = (tune::get().embed_fused
            && rope_fused
            && n == 1
            && pass.linears == Linears::GemvFusedNorm
            && pass.mega.is_none())
        .then_some(EmbedGather {
            ids: mi(meta.ids),
            fed,
            residual: x,
        });
        if embed_gather.is_none() {
            Args::new()
                .p(x)
                .p(self.embed.ptr)
                .p(mi(meta.ids))
                .i(h)
                .p(fed)
                .launch(s, &kn.embed_tokens, (n, 1), 256)?;
        }
        if let Some((params, smem)) = &pass.mega {
            self.mega
                .as_ref()
                .ok_or_else(|| Error::Device("the decode step kernel is not loaded".into()))?
                .launch(s, params, *smem, kv.elem)?;
            return self.record_picks(pass);
        }
        // RMSNorm of `rows` rows of `src`, written as the next GEMM's input: f32 into `xn`, or
        // rounded to bf16 into `xb` in the same launch. Returns where it went.
        // `early`: launched with PDL (pdl=all).
        let norm_pdl = |src: u64, w: u64, rows: usize, early: bool| -> Result<u64> {
            let (out, out_bf16) = match pm {
                Precision::F32 => (xn, 0),
                Precision::Bf16 => (0, xb),
            };
            Args::new()
                .p(out)
                .p(out_bf16)
                .p(src)
                .p(w)
                .i(h)
                .f(cfg.rms_norm_eps)
                .launch_pdl(s, &kn.rms_norm, (rows, 1, 1), 256, 0, early)?;
            Ok(out.max(out_bf16))
        };
        let norm = |src: u64, w: u64, rows: usize| norm_pdl(src, w, rows, false);
        let early = pass.pdl_all;
        // The GEMV kernels' input: the residual stream normalized with `w`, by the kernel itself
        // or by the RMSNorm kernel before it.
        let gemv_normed = |w: u64| -> Result<GemvIn> {
            Ok(match pass.linears {
                Linears::GemvFusedNorm => GemvIn::Normed {
                    x,
                    w,
                    eps: cfg.rms_norm_eps,
                },
                _ => GemvIn::Bf16(norm(x, w, n)?),
            })
        };
        let (gemv, pdl) = (pass.linears != Linears::Cublas, pass.pdl);
        // The L2 prefetches `TAPEDECK_L2_PREFETCH` asks for, in one-row GEMV passes with PDL.
        let prefetch = tune::get().l2_prefetch;
        let prefetching = gemv && pdl && n == 1 && prefetch.any();
        let all = usize::MAX;
        for (li, layer) in self.layers.iter().enumerate() {
            let qkv = [(&layer.q, q), (&layer.k, k), (&layer.v, v)];
            let [kp, vp, ksc, vsc] = kv.layer(li);
            let rope = RopeArgs {
                q,
                k,
                v,
                k_pool: kp,
                v_pool: vp,
                k_scale: ksc,
                v_scale: vsc,
                pos: mi(meta.pos),
                inv_freq: self.inv_freq.ptr,
                slots: mi(meta.slots),
                heads: nh,
                kv_heads: nkv,
                head_dim: hd,
                kv_mode: pass.kv_mode,
                elem: kv.elem,
            };
            if rope_fused {
                // The first layer's input from the embedding table, where the step gathers it.
                let (xin, embed) = match (embed_gather, li) {
                    (Some(e), 0) => {
                        let table = GemvIn::Normed {
                            x: self.embed.ptr,
                            w: layer.attn_norm.ptr,
                            eps: cfg.rms_norm_eps,
                        };
                        (table, Some(e))
                    }
                    _ => (gemv_normed(layer.attn_norm.ptr)?, None),
                };
                self.gpu.qkv_rope(layer, xin, n, &rope, pdl, embed)?;
                FUSED_ROPE.fetch_add(1, Ordering::Relaxed);
            } else if gemv {
                self.gpu
                    .gemv(&qkv, gemv_normed(layer.attn_norm.ptr)?, n, false, pdl)?;
            } else {
                let xin = norm(x, layer.attn_norm.ptr, n)?;
                for (l, y) in qkv {
                    self.gpu.linear(l, xin, n, y, pm)?;
                }
            }
            // While the attention runs, the L2 may fetch what the o and MLP GEMVs read next.
            if prefetching {
                self.gpu.l2_prefetch(&[
                    prefix(&layer.o, if prefetch.o { all } else { 0 }),
                    prefix(&layer.gate, prefetch.mlp_bytes / 2),
                    prefix(&layer.up, prefetch.mlp_bytes / 2),
                ])?;
            }
            // The o projection's input: the attention output, or (fused) the mma kernel's splits.
            let mut o_in = GemvIn::F32(att);
            if !rope_fused {
                rope.append(Args::new()).launch_pdl(
                    s,
                    &pk.rope_kv_write,
                    (n, nh + nkv, 1),
                    hd.div_ceil(32) * 32,
                    0,
                    early,
                )?;
            }
            // The arguments the SIMT attention kernels share: where each token's context is, and
            // the head shapes.
            let context = |a: Args, rows: u64| {
                a.p(mi(meta.tables))
                    .i(meta.max_blocks)
                    .p(mi(meta.seg))
                    .p(mi(meta.ctx))
                    .p(mi(meta.hide))
                    .p(rows)
            };
            let heads = |a: Args, bf16: usize| a.i(nh).i(nkv).i(hd).i(bs).f(pass.scale).i(bf16);
            let attention = |rows: u64, n_rows: usize, scores: u64, stride: usize, bf16: usize| {
                let a = context(Args::new().p(att).p(q).p(kp).p(vp).p(ksc).p(vsc), rows);
                heads(a.p(scores).i(stride), bf16).launch(s, &pk.attention, (n_rows, nh), 128)
            };
            // Prompt chunks through a tiled kernel (same arguments as `attention`, with the
            // tile list where it takes rows and scores): the tensor-core one, or the SIMT one.
            // (`pass.prefill_mma` was decided, and the tile list cut, where the kernel exists.)
            let tiled = if pass.prefill_mma {
                pk.prefill_mma.as_ref().map(|f| {
                    let smem = kernels::prefill_mma_smem(hd, kv.elem.bytes());
                    (f, kernels::PREFILL_MMA_THREADS, smem)
                })
            } else {
                pk.prefill
                    .as_ref()
                    .map(|f| (f, 256, kernels::prefill_smem(hd)))
            };
            if let (Some((f, threads, smem)), 1..) = (tiled, meta.n_tiles) {
                let a = context(
                    Args::new().p(att).p(q).p(kp).p(vp).p(ksc).p(vsc),
                    mi(meta.tiles),
                );
                heads(a, pass.attn_bf16).launch_3d(
                    s,
                    f,
                    (meta.n_tiles * nkv, 1, 1),
                    threads,
                    smem,
                )?;
            }
            if meta.n_simt_rows > 0 {
                attention(mi(meta.simt_rows), meta.n_simt_rows, 0, 0, pass.attn_bf16)?;
            }
            // Decode steps recomputed by their own kernel settings: bf16 operands for
            // attn_decode=mma-bf16 (the SIMT kernel with the tensor-core kernel's roundings), and
            // the sparse top-k selection.
            let (rows, nr) = (mi(meta.decode_rows), meta.n_decode_rows);
            if let Some((top_k, scores, stride)) = pass.topk {
                let a = context(Args::new().p(scores).i(stride).p(q).p(kp).p(ksc), rows);
                heads(a, pass.decode_bf16).launch(s, &pk.attention_scores, (nr, nh), 128)?;
                Args::new()
                    .p(scores)
                    .i(stride)
                    .p(mi(meta.ctx))
                    .p(rows)
                    .i(nh)
                    .i(top_k)
                    .launch(s, &kn.topk_mask, (nr, nh), 256)?;
                attention(rows, nr, scores, stride, pass.decode_bf16)?;
            } else if let Some(m) = &pass.mma {
                // The bf16 tensor-core kernel on the decode rows: gather their queries (unless
                // they are all the rows), attend, merge the splits, scatter the outputs back.
                if m.gather {
                    Args::new().p(m.q_dec).p(q).p(rows).i(q_dim).launch(
                        s,
                        &kn.embed_gather,
                        (nr, 1),
                        256,
                    )?;
                }
                let mma_args = Args::new()
                    .p(m.o_dec)
                    .p(m.q_dec)
                    .p(kp)
                    .p(vp)
                    .p(mi(meta.decode_tables))
                    .p(mi(meta.decode_ctx))
                    .p(m.partial_out)
                    .p(m.partial_ml)
                    .i(meta.max_blocks)
                    .i(nh)
                    .i(nkv)
                    .i(bs)
                    .i(hd)
                    .i(m.split_len)
                    .i(m.max_splits)
                    .f(pass.scale)
                    .p(m.done)
                    .p(ksc)
                    .p(vsc);
                let grid = (nkv, nr, m.max_splits);
                // pdl=all, or pdl=on with TAPEDECK_PDL_ATTN=on: the attention and its combine
                // launch early too.
                let early = early || (pass.pdl && self.gpu.pdl_capable && tune::get().pdl_attn);
                if m.cluster {
                    CLUSTER_MERGES.fetch_add(1, Ordering::Relaxed);
                    mma_args.launch_cluster(
                        s,
                        &pk.decode_mma_cluster,
                        grid,
                        128,
                        kernels::DECODE_MMA_SMEM,
                        m.max_splits,
                        early,
                    )?;
                } else {
                    mma_args.launch_pdl(
                        s,
                        &pk.decode_mma,
                        grid,
                        128,
                        kernels::DECODE_MMA_SMEM,
                        early,
                    )?;
                }
                let merged = MergedSplits {
                    att: m.o_dec,
                    partial_out: m.partial_out,
                    partial_ml: m.partial_ml,
                    ctx: mi(meta.decode_ctx),
                    heads: nh,
                    head_dim: hd,
                    split_len: m.split_len,
                    max_splits: m.max_splits,
                };
                // The o GEMV merges the splits itself when every row is a decode row in order
                // and the merged rows fit its shared memory.
                if pass.fuse.merge
                    && m.done == 0
                    && !m.cluster
                    && !m.gather
                    && m.max_splits <= FUSED_MERGE_MAX_SPLITS
                    && merged.fits(n, q_dim)
                {
                    o_in = GemvIn::Merged(merged);
                    FUSED_MERGE.fetch_add(1, Ordering::Relaxed);
                } else if m.done == 0 && !m.cluster && m.max_splits > 1 {
                    // With one split the mma kernel writes the attention output itself.
                    Args::new()
                        .p(m.o_dec)
                        .p(m.partial_out)
                        .p(m.partial_ml)
                        .p(mi(meta.decode_ctx))
                        .i(nh)
                        .i(hd)
                        .i(m.split_len)
                        .i(m.max_splits)
                        .launch_pdl(s, &kn.decode_combine, (nh, nr, 1), 256, 0, early)?;
                }
                if m.gather {
                    Args::new().p(att).p(m.o_dec).p(rows).i(q_dim).launch(
                        s,
                        &kn.scatter_rows,
                        (nr, 1),
                        256,
                    )?;
                }
            } else if nr > 0 {
                // Shapes the tensor-core kernel does not take (head_dim other than 64 or 128,
                // more than 16 query heads per KV head): the SIMT kernel with its roundings.
                attention(rows, nr, 0, 0, pass.decode_bf16)?;
            }
            if gemv {
                // x += o(att), then x += down(silu(gate(xn)) · up(xn)): three launches (and the
                // L2 prefetches asked for beside them).
                self.gpu.gemv(&[(&layer.o, x)], o_in, n, true, pdl)?;
                if prefetching {
                    self.gpu
                        .l2_prefetch(&[prefix(&layer.down, prefetch.down_bytes)])?;
                }
                let xin = gemv_normed(layer.mlp_norm.ptr)?;
                if let Some(flow) = &pass.mlp_flow {
                    // gate/up and down in one grid (the down prefetch above still applies).
                    self.gpu.mlp_flow(layer, xin, n, act, x, flow, li, pdl)?;
                    FUSED_MLP.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                self.gpu.swiglu(&layer.gate, &layer.up, xin, n, act, pdl)?;
                if let (true, Some(next)) = (prefetching && prefetch.next, self.layers.get(li + 1))
                {
                    let [q, k, v] = [&next.q, &next.k, &next.v].map(|l| prefix(l, all));
                    self.gpu.l2_prefetch(&[q, k, v])?;
                }
                self.gpu
                    .gemv(&[(&layer.down, x)], GemvIn::Bf16(act), n, true, pdl)?;
                continue;
            }
            let ain = self.gpu.gemm_input(att, n * q_dim, xb, pm)?;
            self.gpu.linear(&layer.o, ain, n, tmp, pm)?;
            Args::new()
                .p(x)
                .p(tmp)
                .i(n * h)
                .launch(s, &kn.add_inplace, (elementwise, 1), 256)?;
            let xin = norm(x, layer.mlp_norm.ptr, n)?;
            self.gpu.linear(&layer.gate, xin, n, g, pm)?;
            self.gpu.linear(&layer.up, xin, n, u, pm)?;
            // silu(g)·u, in place in f32 or rounded into `xb` for a bf16 down projection.
            let gin = match pm {
                Precision::F32 => g,
                Precision::Bf16 => xb,
            };
            Args::new()
                .p(g)
                .p(if gin == xb { xb } else { 0 })
                .p(u)
                .i(n * inter)
                .launch(s, &kn.silu_mul, ((n * inter).div_ceil(256), 1), 256)?;
            self.gpu.linear(&layer.down, gin, n, tmp, pm)?;
            Args::new()
                .p(x)
                .p(tmp)
                .i(n * h)
                .launch(s, &kn.add_inplace, (elementwise, 1), 256)?;
        }
        // Final norm and head on the rows asked for: gather them (into `tmp`), norm, project;
        // then pick tokens where asked.
        let r = meta.n_logit_rows;
        if r == 0 {
            return Ok(());
        }
        let rows_in = if pass.logits_in_place {
            x
        } else {
            Args::new().p(tmp).p(x).p(mi(meta.logit_rows)).i(h).launch(
                s,
                &kn.embed_gather,
                (r, 1),
                256,
            )?;
            tmp
        };
        if gemv {
            // With `fuse.head` the final RMSNorm runs inside the head's GEMV, as before q/k/v and
            // gate/up.
            let hin = if pass.fuse.head && pass.linears == Linears::GemvFusedNorm {
                GemvIn::Normed {
                    x: rows_in,
                    w: self.norm.ptr,
                    eps: cfg.rms_norm_eps,
                }
            } else {
                GemvIn::Bf16(norm_pdl(rows_in, self.norm.ptr, r, early)?)
            };
            self.gpu
                .gemv(&[(&self.head, pass.logits)], hin, r, false, pdl)?;
            // Beside the head, the next step's first weights.
            if let (true, Some(first)) = (prefetching && prefetch.first, self.layers.first()) {
                let [q, k, v, o] = [&first.q, &first.k, &first.v, &first.o].map(|l| prefix(l, all));
                self.gpu.l2_prefetch(&[q, k, v, o])?;
            }
        } else {
            let hin = norm_pdl(rows_in, self.norm.ptr, r, early)?;
            self.gpu.linear(&self.head, hin, r, pass.logits, pm)?;
        }
        self.record_picks(pass)
    }

    /// The token picks of a pass (after its head), where asked.
    pub(super) fn record_picks(&self, pass: &Pass) -> Result<()> {
        let early = pass.pdl_all || (pass.pdl && self.gpu.pdl_capable && tune::get().pdl_picks);
        let (meta, s, kn) = (&pass.meta, &self.gpu.stream, &self.gpu.k);
        let mi = |off: usize| pass.meta_ptr + (off * 4) as u64;
        let vocab = self.head.out;
        if let Some((stats, top, out, chunks)) = pass.pick {
            let (p, k) = (meta.n_picks, meta.pick_k);
            Args::new()
                .p(pass.logits)
                .i(vocab)
                .p(mi(meta.pick_rows))
                .i(k)
                .p(stats)
                .p(top)
                .launch_pdl(s, &kn.pick_partial, (p, chunks, 1), 256, 0, early)?;
            Args::new()
                .p(pass.logits)
                .i(vocab)
                .p(mi(meta.pick_rows))
                .p(mi(meta.pick_chosen))
                .i(k)
                .i(chunks)
                .p(stats)
                .p(top)
                .p(out)
                .launch_pdl(s, &kn.pick_finish, (p, 1, 1), 256, 0, early)?;
        }
        Ok(())
    }

    /// Copies back what each segment asked for (picked tokens, or whole rows) and waits for the
    /// pass to finish (timed as [`Part::Wait`] in `laps`).
    pub(super) fn collect(
        &mut self,
        segs: &[Segment<'_>],
        pass: &Pass,
        vocab: usize,
        laps: &mut Laps,
    ) -> Result<Vec<Logits>> {
        let meta = &pass.meta;
        let stream = self.gpu.stream.cu_stream();
        let words = pick_words(meta.pick_k);
        let n_words = meta.n_picks * words;
        if let Some((_, _, out, _)) = pass.pick {
            self.copies.download(out, n_words, &self.gpu.stream)?;
        }
        // Rows for the segments that sample on the host (or keep more alternatives than the
        // device picks), each segment's rows contiguous in the logits buffer.
        let mut rows: Vec<Option<Vec<f32>>> = segs.iter().map(|_| None).collect();
        let mut at = 0usize;
        for (i, sg) in segs.iter().enumerate() {
            let n = sg.logit_rows().len();
            if n > 0 && meta.pick_slot[i].is_none() {
                let mut host = vec![0.0f32; n * vocab];
                let src = pass.logits + (at * vocab * 4) as u64;
                // SAFETY: rows at..at+n lie inside the logits buffer.
                unsafe { dr::memcpy_dtoh_async(&mut host, src, stream) }
                    .map_err(|e| dev_err("downloading logits", e))?;
                rows[i] = Some(host);
            }
            at += n;
        }
        self.gpu
            .stream
            .synchronize()
            .map_err(|e| dev_err("forward pass", e))?;
        laps.lap(Part::Wait);
        let picks = match pass.pick {
            Some(_) => self.copies.downloaded(n_words)?,
            None => &[],
        };
        Ok(segs
            .iter()
            .zip(rows)
            .enumerate()
            .map(|(i, (sg, host))| match (meta.pick_slot[i], host) {
                (Some(slot), _) => parse_pick(
                    &picks[slot * words..(slot + 1) * words],
                    device_pick(sg.want, vocab).map_or(0, |p| p.k),
                ),
                (None, Some(host)) => match sg.want {
                    WantLogits::Pick(p) => Logits::pick(&host, p),
                    _ => Logits::Rows(host),
                },
                (None, None) => Logits::Rows(Vec::new()),
            })
            .collect())
    }
}
