//! Llama-family decoder (Llama 2/3, Qwen2, Mistral) on the CPU, f32 reference with toggles.
//!
//! Paper: "LLaMA: Open and Efficient Foundation Language Models" (arXiv:2302.13971); reference
//! implementation: Hugging Face transformers `modeling_llama.py` / `modeling_qwen2.py`, which the
//! golden tests compare against.
//!
//! A forward pass takes a batch of [`Segment`]s — runs of new tokens of different sequences, each
//! with its own KV cache — so prefill chunks and decode steps of many sequences share every linear
//! layer. Attention is per segment. Because [`matmul_t`] is batch-invariant, a segment's outputs do
//! not depend on the other segments in the batch.

use std::sync::OnceLock;

use rayon::prelude::*;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::generate::LogitsSummary;
use crate::kv_host::HostRows;
use crate::numerics::{matmul_t, rms_norm, round_bf16, round_bf16_slice, silu_mul};
use crate::sampling::{argmax, summarize};
use crate::toggles::{KvDtype, Precision, Toggles};
use crate::weights::WeightStore;

/// A linear layer `y = x·Wᵀ + b` with `W` stored `(out, in)`.
pub(crate) struct Linear {
    /// (out, in)
    pub(crate) w: Vec<f32>,
    /// (out)
    pub(crate) b: Option<Vec<f32>>,
    pub(crate) out: usize,
    pub(crate) inp: usize,
    /// `w` rounded to bf16, made on first use of `matmul=bf16`.
    w_bf16: OnceLock<Vec<f32>>,
    /// The checkpoint stored `w` in bf16, so it is already bf16-exact.
    stored_bf16: bool,
}

impl Linear {
    fn load(ws: &mut WeightStore, name: &str, out: usize, inp: usize, bias: bool) -> Result<Self> {
        let w = ws.take(&format!("{name}.weight"), &[out, inp])?;
        let b = if bias {
            Some(ws.take(&format!("{name}.bias"), &[out])?.data)
        } else {
            None
        };
        Ok(Linear {
            stored_bf16: w.stored_as == safetensors::Dtype::BF16,
            w: w.data,
            b,
            out,
            inp,
            w_bf16: OnceLock::new(),
        })
    }

    fn weights(&self, p: Precision) -> &[f32] {
        match p {
            Precision::Bf16 if !self.stored_bf16 => self.w_bf16.get_or_init(|| {
                let mut w = self.w.clone();
                round_bf16_slice(&mut w);
                w
            }),
            _ => &self.w,
        }
    }

    /// `out (n, self.out) = x (n, self.inp) · Wᵀ + b`; with bf16, inputs are rounded first.
    fn forward(&self, x: &[f32], n: usize, out: &mut [f32], p: Precision, scratch: &mut Vec<f32>) {
        let xin: &[f32] = if p == Precision::Bf16 {
            scratch.clear();
            scratch.extend(x.iter().map(|&v| round_bf16(v)));
            scratch
        } else {
            x
        };
        matmul_t(
            xin,
            self.weights(p),
            self.b.as_deref(),
            n,
            self.inp,
            self.out,
            out,
        );
    }
}

pub(crate) struct Layer {
    /// (hidden)
    pub(crate) attn_norm: Vec<f32>,
    pub(crate) q: Linear,
    pub(crate) k: Linear,
    pub(crate) v: Linear,
    pub(crate) o: Linear,
    /// (hidden)
    pub(crate) mlp_norm: Vec<f32>,
    pub(crate) gate: Linear,
    pub(crate) up: Linear,
    pub(crate) down: Linear,
}

/// Which logits a segment wants back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WantLogits {
    /// None (a prefill chunk that is not the last).
    None,
    /// The last token's (generation).
    Last,
    /// Every token's (scoring).
    All,
    /// The last token's, reduced by the backend to the token chosen and its summary: all that
    /// greedy decoding and teacher forcing need, so a GPU copies back a few hundred bytes instead
    /// of a vocabulary of logits per step.
    Pick(Pick),
}

/// How [`WantLogits::Pick`] reduces a row of logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pick {
    /// Alternatives kept in the summary.
    pub k: usize,
    /// The token whose log-probability is wanted (teacher forcing), or `None` for the most
    /// likely one (greedy decoding; ties go to the lower ID, as [`argmax`] breaks them).
    pub token: Option<u32>,
}

/// What a forward pass hands back for one segment.
#[derive(Debug, Clone, PartialEq)]
pub enum Logits {
    /// `(rows, vocab)` flattened, f32: the rows [`WantLogits`] asked for (none for `None`).
    Rows(Vec<f32>),
    /// [`WantLogits::Pick`]'s reduction of the last row.
    Picked {
        /// The token chosen (given, or the most likely).
        token: u32,
        /// The distribution it came from, with `logprob` that of `token`.
        summary: LogitsSummary,
    },
}

impl Logits {
    /// The rows of logits; an error for a picked result (a caller asked for a pick and then
    /// wanted rows, which is a bug, not bad input).
    pub fn into_rows(self) -> Result<Vec<f32>> {
        match self {
            Logits::Rows(rows) => Ok(rows),
            Logits::Picked { .. } => Err(Error::Device(
                "a forward pass returned a picked token where logits were expected".into(),
            )),
        }
    }

    /// Whether there is nothing in it (a prefill chunk that wanted no logits).
    pub fn is_empty(&self) -> bool {
        matches!(self, Logits::Rows(r) if r.is_empty())
    }

    /// The summary of `token` (with `k` alternatives), whichever form the result came back in.
    pub fn summary_of(self, token: u32, k: usize) -> Result<LogitsSummary> {
        match self {
            Logits::Picked { summary, .. } => Ok(summary),
            Logits::Rows(row) if !row.is_empty() => Ok(summarize(&row, token, k)),
            Logits::Rows(_) => Err(Error::Device("a forward pass returned no logits".into())),
        }
    }

    /// Reduces one row of logits as `pick` says (the reference for every backend).
    pub fn pick(row: &[f32], pick: Pick) -> Logits {
        let token = pick.token.unwrap_or_else(|| argmax(row));
        Logits::Picked {
            token,
            summary: summarize(row, token, pick.k),
        }
    }
}

/// Key/value storage for many sequences, in fixed-size blocks (paged attention's layout).
///
/// A sequence owns a [`BlockTable`] listing the blocks that hold its positions in order; two
/// sequences with a common prefix can list the same full blocks (the prefix cache). The pool has
/// one storage type: the CPU backend stores a `kv_dtype` in that type's own size (see
/// [`crate::kv_host`]), so a bf16 pool holds twice the tokens of an f32 one and an FP8 pool
/// nearly four times, and so does the CUDA backend; an f32 pool holds any `kv_dtype` as f32 holding
/// the rounded values. The layout is (block, position, KV head, head_dim) either way.
#[derive(Debug)]
pub struct KvPool {
    block_size: usize,
    kv_dim: usize,
    head_dim: usize,
    num_blocks: usize,
    storage: KvStorage,
}

/// Where a pool's numbers live.
#[derive(Debug)]
pub(crate) enum KvStorage {
    /// Per layer: (num_blocks, block_size, kv_heads, head_dim) keys and values, all in `dtype`.
    Host {
        dtype: KvDtype,
        k: Vec<HostRows>,
        v: Vec<HostRows>,
    },
    /// The same layout in GPU memory, in the pool's element type (`cuda::KvElem`).
    Cuda(crate::cuda::DeviceKv),
}

impl KvPool {
    /// A host pool of `num_blocks` blocks of `block_size` positions for a model, storing `dtype`.
    pub fn new(cfg: &Config, block_size: usize, num_blocks: usize, dtype: KvDtype) -> Self {
        let kv_dim = cfg.num_kv_heads * cfg.head_dim;
        let per_layer = num_blocks * block_size * kv_dim;
        let layers = || {
            (0..cfg.num_layers)
                .map(|_| HostRows::new(dtype, per_layer, cfg.head_dim))
                .collect()
        };
        KvPool {
            block_size,
            kv_dim,
            head_dim: cfg.head_dim,
            num_blocks,
            storage: KvStorage::Host {
                dtype,
                k: layers(),
                v: layers(),
            },
        }
    }

    /// A pool over device storage (built by the CUDA backend).
    pub(crate) fn on_device(
        cfg: &Config,
        block_size: usize,
        num_blocks: usize,
        kv: crate::cuda::DeviceKv,
    ) -> Self {
        KvPool {
            block_size,
            kv_dim: cfg.num_kv_heads * cfg.head_dim,
            head_dim: cfg.head_dim,
            num_blocks,
            storage: KvStorage::Cuda(kv),
        }
    }

    /// The type values are stored in.
    pub fn storage_dtype(&self) -> KvDtype {
        match &self.storage {
            KvStorage::Host { dtype, .. } => *dtype,
            KvStorage::Cuda(kv) => kv.storage_dtype(),
        }
    }

    /// Bytes one block takes across all layers (keys and values).
    pub fn block_bytes(&self) -> usize {
        let layers = self.num_layers();
        let heads = self.kv_dim / self.head_dim.max(1);
        2 * layers
            * self.block_size
            * heads
            * HostRows::head_bytes(self.storage_dtype(), self.head_dim)
    }

    /// Positions per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Adds `n` blocks (for single-sequence use, where the pool grows with the sequence).
    pub fn grow(&mut self, n: usize) -> Result<()> {
        let new_blocks = self.num_blocks + n;
        let per_layer = new_blocks * self.block_size * self.kv_dim;
        match &mut self.storage {
            KvStorage::Host { k, v, .. } => {
                for l in k.iter_mut().chain(v.iter_mut()) {
                    l.resize(per_layer, self.head_dim);
                }
            }
            KvStorage::Cuda(kv) => kv.grow(per_layer)?,
        }
        self.num_blocks = new_blocks;
        Ok(())
    }

    /// Whether the pool lives in GPU memory, where growing it moves it (and invalidates the
    /// CUDA graphs captured over its old addresses).
    pub fn is_on_device(&self) -> bool {
        matches!(self.storage, KvStorage::Cuda(_))
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.num_blocks * self.block_bytes()
    }

    fn num_layers(&self) -> usize {
        match &self.storage {
            KvStorage::Host { k, .. } => k.len(),
            KvStorage::Cuda(kv) => kv.num_layers(),
        }
    }

    /// The device storage, for the CUDA backend.
    pub(crate) fn device_mut(&mut self) -> Result<&mut crate::cuda::DeviceKv> {
        match &mut self.storage {
            KvStorage::Cuda(kv) => Ok(kv),
            KvStorage::Host { .. } => Err(Error::Device(
                "a host KV pool was passed to the CUDA backend".into(),
            )),
        }
    }
}

/// The blocks holding one sequence's positions, in order, and how many positions are filled.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockTable {
    /// Block IDs in the pool.
    pub blocks: Vec<u32>,
    /// Positions filled.
    pub len: usize,
}

impl BlockTable {
    /// Row index in the pool's per-layer arrays of position `pos`.
    #[inline]
    pub(crate) fn slot(&self, pos: usize, block_size: usize) -> usize {
        self.blocks[pos / block_size] as usize * block_size + pos % block_size
    }
}

/// A single sequence's cache: a private, growing pool and its table. What [`Engine`] uses for
/// one request at a time; the scheduler shares one pool among many sequences instead.
///
/// [`Engine`]: crate::Engine
#[derive(Debug)]
pub struct KvCache {
    /// The pool.
    pub pool: KvPool,
    /// The sequence's table.
    pub table: BlockTable,
}

impl KvCache {
    /// An empty host cache for a model (the CPU backend's), storing `dtype`.
    pub fn new(cfg: &Config, dtype: KvDtype) -> Self {
        Self::in_pool(KvPool::new(cfg, 16, 0, dtype))
    }

    /// An empty cache over an empty pool of any backend.
    pub fn in_pool(pool: KvPool) -> Self {
        KvCache {
            pool,
            table: BlockTable::default(),
        }
    }

    /// Positions cached.
    pub fn len(&self) -> usize {
        self.table.len
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.table.len == 0
    }

    /// Makes room for `n` more positions.
    pub fn reserve(&mut self, n: usize) -> Result<()> {
        let bs = self.pool.block_size;
        let need = (self.table.len + n).div_ceil(bs);
        if self.table.blocks.len() < need {
            let add = need - self.table.blocks.len();
            let first = self.pool.num_blocks;
            self.pool.grow(add)?;
            self.table
                .blocks
                .extend((first..first + add).map(|b| b as u32));
        }
        Ok(())
    }

    /// A segment over this cache.
    pub fn segment<'a>(
        &'a mut self,
        tokens: &'a [u32],
        decode: bool,
        want: WantLogits,
    ) -> Result<(&'a mut KvPool, Segment<'a>)> {
        self.reserve(tokens.len())?;
        Ok((
            &mut self.pool,
            Segment {
                tokens,
                table: &mut self.table,
                decode,
                want,
                fault_chunk_boundary: false,
            },
        ))
    }
}

/// New tokens of one sequence in a forward pass.
pub struct Segment<'a> {
    /// The tokens, at positions `table.len..table.len + tokens.len()`.
    pub tokens: &'a [u32],
    /// The sequence's blocks, already covering the new positions; the pass writes these tokens'
    /// keys and values there and advances `len`.
    pub table: &'a mut BlockTable,
    /// A decode step (one token after the prompt): sparse `decode_topk` applies only here.
    pub decode: bool,
    /// Which logits to return.
    pub want: WantLogits,
    /// FAULT `fault.chunk=boundary`: the first token of this segment cannot see the token just
    /// before it (an off-by-one in the causal mask at a prefill-chunk boundary).
    pub fault_chunk_boundary: bool,
}

impl Segment<'_> {
    /// The rows of this segment's new tokens whose logits it wants, counted from its first token.
    pub(crate) fn logit_rows(&self) -> std::ops::Range<usize> {
        let len = self.tokens.len();
        match self.want {
            WantLogits::None => 0..0,
            WantLogits::Last | WantLogits::Pick(_) => len - 1..len,
            WantLogits::All => 0..len,
        }
    }
}

/// The position the chunk-boundary fault hides from the token at `pos` of a segment that starts
/// at `start`: the token just before the chunk, from the chunk's first token only.
pub(crate) fn chunk_boundary_hidden(fault: bool, start: usize, pos: usize) -> Option<usize> {
    (fault && pos == start && pos > 0).then(|| pos - 1)
}

/// A loaded model.
pub struct Model {
    pub(crate) cfg: Config,
    /// (vocab, hidden)
    pub(crate) embed: Vec<f32>,
    pub(crate) layers: Vec<Layer>,
    /// (hidden)
    pub(crate) norm: Vec<f32>,
    /// (vocab, hidden); `None` when tied to `embed`.
    pub(crate) lm_head: Option<Linear>,
    /// Tied head as a Linear view over a copy of `embed` (kept separate so bf16 rounding is cached).
    pub(crate) tied_head: Option<Linear>,
    /// (head_dim / 2)
    pub(crate) inv_freq: Vec<f32>,
}

impl Model {
    /// Loads weights for `cfg` from a store, checking every shape.
    pub fn load(cfg: Config, ws: &mut WeightStore) -> Result<Self> {
        let h = cfg.hidden_size;
        let q_dim = cfg.num_heads * cfg.head_dim;
        let kv_dim = cfg.num_kv_heads * cfg.head_dim;
        let embed = ws.take("model.embed_tokens.weight", &[cfg.vocab_size, h])?;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let p = format!("model.layers.{i}");
            layers.push(Layer {
                attn_norm: ws.take(&format!("{p}.input_layernorm.weight"), &[h])?.data,
                q: Linear::load(ws, &format!("{p}.self_attn.q_proj"), q_dim, h, cfg.qkv_bias)?,
                k: Linear::load(
                    ws,
                    &format!("{p}.self_attn.k_proj"),
                    kv_dim,
                    h,
                    cfg.qkv_bias,
                )?,
                v: Linear::load(
                    ws,
                    &format!("{p}.self_attn.v_proj"),
                    kv_dim,
                    h,
                    cfg.qkv_bias,
                )?,
                o: Linear::load(ws, &format!("{p}.self_attn.o_proj"), h, q_dim, cfg.o_bias)?,
                mlp_norm: ws
                    .take(&format!("{p}.post_attention_layernorm.weight"), &[h])?
                    .data,
                gate: Linear::load(
                    ws,
                    &format!("{p}.mlp.gate_proj"),
                    cfg.intermediate_size,
                    h,
                    false,
                )?,
                up: Linear::load(
                    ws,
                    &format!("{p}.mlp.up_proj"),
                    cfg.intermediate_size,
                    h,
                    false,
                )?,
                down: Linear::load(
                    ws,
                    &format!("{p}.mlp.down_proj"),
                    h,
                    cfg.intermediate_size,
                    false,
                )?,
            });
        }
        let norm = ws.take("model.norm.weight", &[h])?.data;
        let tied = cfg.tie_word_embeddings || !ws.contains("lm_head.weight");
        let lm_head = if tied {
            None
        } else {
            Some(Linear::load(ws, "lm_head", cfg.vocab_size, h, false)?)
        };
        let tied_head = tied.then(|| Linear {
            w: embed.data.clone(),
            b: None,
            out: cfg.vocab_size,
            inp: h,
            w_bf16: OnceLock::new(),
            stored_bf16: embed.stored_as == safetensors::Dtype::BF16,
        });
        let leftover: Vec<String> = ws
            .remaining()
            .into_iter()
            .filter(|n| !n.contains("rotary_emb"))
            .collect();
        if !leftover.is_empty() {
            tracing::warn!(tensors = ?leftover, "checkpoint tensors not used by the model");
        }
        Ok(Model {
            inv_freq: cfg.inv_freq(),
            cfg,
            embed: embed.data,
            layers,
            norm,
            lm_head,
            tied_head,
        })
    }

    /// The output head (the tied embedding or `lm_head`).
    pub(crate) fn head(&self) -> Result<&Linear> {
        self.lm_head
            .as_ref()
            .or(self.tied_head.as_ref())
            .ok_or_else(|| Error::InvalidConfig("model has no output head".into()))
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The usable context window.
    pub fn context_len(&self) -> usize {
        match self.cfg.sliding_window {
            Some(w) => w.min(self.cfg.max_position_embeddings),
            None => self.cfg.max_position_embeddings,
        }
    }

    /// Runs new tokens of several sequences through the model, appending to their caches, and
    /// returns for each segment the logits it asked for (`(rows, vocab)` flattened, or picked).
    pub fn forward(
        &self,
        pool: &mut KvPool,
        segs: &mut [Segment<'_>],
        toggles: &Toggles,
    ) -> Result<Vec<Logits>> {
        let cfg = &self.cfg;
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let (nh, nkv) = (cfg.num_heads, cfg.num_kv_heads);
        let (q_dim, kv_dim) = (nh * hd, nkv * hd);
        let where_ = batch_positions(cfg, self.context_len(), pool.block_size(), segs)?;
        let n = where_.len();
        if n == 0 {
            return Ok(segs.iter().map(|_| Logits::Rows(Vec::new())).collect());
        }
        let bs = pool.block_size;
        pool.storage_dtype().check_holds(toggles.kv_dtype)?;
        let KvStorage::Host {
            k: pool_k,
            v: pool_v,
            ..
        } = &mut pool.storage
        else {
            return Err(Error::Device(
                "a device KV pool was passed to the CPU backend".into(),
            ));
        };
        let pm = toggles.matmul;
        // (n, hidden) residual stream
        let mut x = Vec::with_capacity(n * h);
        for s in segs.iter() {
            for &t in s.tokens {
                x.extend_from_slice(&self.embed[t as usize * h..(t as usize + 1) * h]);
            }
        }
        let mut xn = vec![0.0f32; n * h]; // (n, hidden)
        let mut q = vec![0.0f32; n * q_dim]; // (n, heads, head_dim)
        let mut k = vec![0.0f32; n * kv_dim]; // (n, kv_heads, head_dim)
        let mut v = vec![0.0f32; n * kv_dim]; // (n, kv_heads, head_dim)
        let mut att = vec![0.0f32; n * q_dim]; // (n, heads, head_dim)
        let mut tmp = vec![0.0f32; n * h]; // (n, hidden)
        let mut g = vec![0.0f32; n * cfg.intermediate_size]; // (n, intermediate)
        let mut u = vec![0.0f32; n * cfg.intermediate_size]; // (n, intermediate)
        let mut scratch = Vec::new();
        // A packed pool's keys and values of one sequence, decoded, and their block table.
        let mut dense = (HostRows::F32(Vec::new()), HostRows::F32(Vec::new()));
        let mut identity: Vec<u32> = Vec::new();
        let views: Vec<SeqView> = segs
            .iter()
            .map(|s| SeqView {
                blocks: &s.table.blocks,
                start: s.table.len,
                decode: s.decode,
                fault_chunk_boundary: s.fault_chunk_boundary,
            })
            .collect();

        for (li, layer) in self.layers.iter().enumerate() {
            rms_norm(&x, &layer.attn_norm, cfg.rms_norm_eps, &mut xn);
            layer.q.forward(&xn, n, &mut q, pm, &mut scratch);
            layer.k.forward(&xn, n, &mut k, pm, &mut scratch);
            layer.v.forward(&xn, n, &mut v, pm, &mut scratch);
            for (t, &(_, pos)) in where_.iter().enumerate() {
                self.rope(&mut q[t * q_dim..(t + 1) * q_dim], pos);
                self.rope(&mut k[t * kv_dim..(t + 1) * kv_dim], pos);
            }
            // Keys and values are stored as the cache dtype holds them (rounded per head).
            for (t, &(si, pos)) in where_.iter().enumerate() {
                let row = segs[si].table.slot(pos, bs) * kv_dim;
                for h in 0..nkv {
                    let src = t * kv_dim + h * hd..t * kv_dim + (h + 1) * hd;
                    pool_k[li].store(row + h * hd, &k[src.clone()], toggles.kv_dtype);
                    pool_v[li].store(row + h * hd, &v[src], toggles.kv_dtype);
                }
            }
            let rows = AttnRows {
                q: &q,
                where_: &where_,
                views: &views,
                heads: nh,
                kv_heads: nkv,
                hd,
                toggles,
            };
            if pool_k[li].is_f32() {
                let layer_kv = LayerKv {
                    k: &pool_k[li],
                    v: &pool_v[li],
                    block_size: bs,
                    kv_dim,
                    hd,
                };
                rows.attend(0, &layer_kv, None, &mut att);
            } else {
                // A packed pool: each sequence's cached keys and values are decoded once per
                // layer into f32 in position order, so attention decodes each value once instead
                // of once per query head and token (the same values, so the same bits).
                let mut t0 = 0;
                for s in segs.iter() {
                    let len = s.tokens.len();
                    let ctx = s.table.len + len;
                    let blocks = &s.table.blocks;
                    pool_k[li].gather(blocks, ctx, bs, kv_dim, hd, &mut dense.0);
                    pool_v[li].gather(blocks, ctx, bs, kv_dim, hd, &mut dense.1);
                    identity.clear();
                    identity.extend(0..ctx.div_ceil(bs) as u32);
                    let layer_kv = LayerKv {
                        k: &dense.0,
                        v: &dense.1,
                        block_size: bs,
                        kv_dim,
                        hd,
                    };
                    let out = &mut att[t0 * q_dim..(t0 + len) * q_dim];
                    rows.attend(t0, &layer_kv, Some(&identity), out);
                    t0 += len;
                }
            }
            layer.o.forward(&att, n, &mut tmp, pm, &mut scratch);
            for (a, b) in x.iter_mut().zip(&tmp) {
                *a += b;
            }
            rms_norm(&x, &layer.mlp_norm, cfg.rms_norm_eps, &mut xn);
            layer.gate.forward(&xn, n, &mut g, pm, &mut scratch);
            layer.up.forward(&xn, n, &mut u, pm, &mut scratch);
            silu_mul(&mut g, &u);
            layer.down.forward(&g, n, &mut tmp, pm, &mut scratch);
            for (a, b) in x.iter_mut().zip(&tmp) {
                *a += b;
            }
        }
        for s in segs.iter_mut() {
            s.table.len += s.tokens.len();
        }
        // Final norm and head only on the rows asked for.
        let head = self.head()?;
        let mut out = Vec::with_capacity(segs.len());
        let mut t0 = 0;
        for s in segs.iter() {
            let len = s.tokens.len();
            let rows = s.logit_rows();
            let rows = t0 + rows.start..t0 + rows.end;
            let r = rows.len();
            let mut logits = vec![0.0f32; r * cfg.vocab_size];
            if r > 0 {
                let mut normed = vec![0.0f32; r * h];
                rms_norm(
                    &x[rows.start * h..rows.end * h],
                    &self.norm,
                    cfg.rms_norm_eps,
                    &mut normed,
                );
                head.forward(&normed, r, &mut logits, pm, &mut scratch);
            }
            out.push(match s.want {
                WantLogits::Pick(p) => Logits::pick(&logits, p),
                _ => Logits::Rows(logits),
            });
            t0 += len;
        }
        Ok(out)
    }

    /// Rotates each head of `x` (heads × head_dim) for position `pos`, rotate-half convention:
    /// dimension `i` pairs with `i + head_dim/2`.
    fn rope(&self, x: &mut [f32], pos: usize) {
        let hd = self.cfg.head_dim;
        let half = hd / 2;
        for head in x.chunks_exact_mut(hd) {
            for i in 0..half {
                // The reference multiplies position by frequency in f32.
                let angle = pos as f32 * self.inv_freq[i];
                let (sin, cos) = angle.sin_cos();
                let (a, b) = (head[i], head[i + half]);
                head[i] = a * cos - b * sin;
                head[i + half] = b * cos + a * sin;
            }
        }
    }
}

/// Checks a batch of segments against the model and the pool and lists, for every token of the
/// batch in order, `(segment index, absolute position)`. Every backend validates the same way.
pub(crate) fn batch_positions(
    cfg: &Config,
    context_len: usize,
    block_size: usize,
    segs: &[Segment<'_>],
) -> Result<Vec<(usize, usize)>> {
    let mut where_: Vec<(usize, usize)> = Vec::new();
    for (si, s) in segs.iter().enumerate() {
        let start = s.table.len;
        if (start + s.tokens.len()).div_ceil(block_size) > s.table.blocks.len() {
            return Err(Error::InvalidRequest(format!(
                "block table of {} blocks cannot hold {} positions",
                s.table.blocks.len(),
                start + s.tokens.len()
            )));
        }
        if start + s.tokens.len() > context_len {
            return Err(Error::ContextOverflow {
                prompt_tokens: start + s.tokens.len(),
                context: context_len,
            });
        }
        for (i, &t) in s.tokens.iter().enumerate() {
            if t as usize >= cfg.vocab_size {
                return Err(Error::InvalidRequest(format!(
                    "token id {t} is outside the vocabulary of {}",
                    cfg.vocab_size
                )));
            }
            where_.push((si, start + i));
        }
    }
    Ok(where_)
}

/// One sequence as attention sees it during a pass.
struct SeqView<'a> {
    blocks: &'a [u32],
    /// First position written in this pass.
    start: usize,
    decode: bool,
    fault_chunk_boundary: bool,
}

/// The query rows of one forward pass, ready for attention.
struct AttnRows<'a> {
    /// (n, heads, head_dim) rotated queries.
    q: &'a [f32],
    /// `(segment, position)` of each row.
    where_: &'a [(usize, usize)],
    views: &'a [SeqView<'a>],
    heads: usize,
    kv_heads: usize,
    hd: usize,
    toggles: &'a Toggles,
}

impl AttnRows<'_> {
    /// Attention of rows `t0..` (as many as `out` holds, `(rows, heads, head_dim)`) over `kv`,
    /// through each sequence's block table or, for a dense copy of one sequence, `blocks`.
    fn attend(&self, t0: usize, kv: &LayerKv<'_>, blocks: Option<&[u32]>, out: &mut [f32]) {
        let (nh, hd) = (self.heads, self.hd);
        let q_dim = nh * hd;
        out.par_chunks_mut(hd).enumerate().for_each(|(idx, out)| {
            let (t, head) = (t0 + idx / nh, idx % nh);
            let (si, pos) = self.where_[t];
            let view = &self.views[si];
            let qh = &self.q[t * q_dim + head * hd..t * q_dim + (head + 1) * hd];
            let kvh = head / (nh / self.kv_heads);
            // The faulty mask hides the previous token from a chunk's first token.
            let hide = chunk_boundary_hidden(view.fault_chunk_boundary, view.start, pos);
            attend(
                qh,
                kv,
                blocks.unwrap_or(view.blocks),
                pos + 1,
                hide,
                kvh,
                view.decode,
                self.toggles,
                out,
            );
        });
    }
}

/// One layer's paged keys and values.
struct LayerKv<'a> {
    /// (num_blocks, block_size, kv_heads, head_dim)
    k: &'a HostRows,
    /// (num_blocks, block_size, kv_heads, head_dim)
    v: &'a HostRows,
    block_size: usize,
    kv_dim: usize,
    hd: usize,
}

/// Scratch buffers of [`attend`]: (scores, positions, query, key, value).
type AttnScratch = (Vec<f32>, Vec<usize>, Vec<f32>, Vec<f32>, Vec<f32>);

thread_local! {
    /// Per-thread scratch of [`attend`], grown as needed and reused, so attention allocates
    /// nothing per call once warm.
    static ATTN_SCRATCH: std::cell::RefCell<AttnScratch> =
        const {
            std::cell::RefCell::new((Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new()))
        };
}

/// Attention of one query head over the first `ctx` positions of its KV head (`hide`: one
/// position masked out by the chunk-boundary fault).
#[allow(clippy::too_many_arguments)]
fn attend(
    q: &[f32],
    kv: &LayerKv<'_>,
    blocks: &[u32],
    ctx: usize,
    hide: Option<usize>,
    kvh: usize,
    decode: bool,
    toggles: &Toggles,
    out: &mut [f32],
) {
    ATTN_SCRATCH.with(|cell| {
        let mut guard = cell.borrow_mut();
        let (scores, positions, qv, kbuf, vbuf) = &mut *guard;
        attend_with(
            q, kv, blocks, ctx, hide, kvh, decode, toggles, out, scores, positions, qv, kbuf, vbuf,
        );
    });
}

#[allow(clippy::too_many_arguments)]
fn attend_with(
    q: &[f32],
    kv: &LayerKv<'_>,
    blocks: &[u32],
    ctx: usize,
    hide: Option<usize>,
    kvh: usize,
    decode: bool,
    toggles: &Toggles,
    out: &mut [f32],
    scores: &mut Vec<f32>,
    positions: &mut Vec<usize>,
    qv: &mut Vec<f32>,
    kbuf: &mut Vec<f32>,
    vbuf: &mut Vec<f32>,
) {
    let hd = kv.hd;
    let bs = kv.block_size;
    let scale = 1.0 / (hd as f32).sqrt();
    let bf16 = toggles.attention_bf16(decode);
    qv.clear();
    qv.extend_from_slice(q);
    kbuf.resize(hd, 0.0);
    vbuf.resize(hd, 0.0);
    if bf16 {
        round_bf16_slice(qv);
    }
    // Row offset of position `j` of this KV head: blocks are walked once, not divided per j.
    let offset = |j: usize| (blocks[j / bs] as usize * bs + j % bs) * kv.kv_dim + kvh * hd;
    scores.clear();
    for (b, &block) in blocks.iter().enumerate().take(ctx.div_ceil(bs)) {
        let base = block as usize * bs;
        let n = bs.min(ctx - b * bs);
        for off in 0..n {
            let o = (base + off) * kv.kv_dim + kvh * hd;
            let kj = kv.k.head(o, hd, bf16, kbuf);
            scores.push(crate::numerics::dot(qv, kj) * scale);
        }
    }
    positions.clear();
    positions.extend((0..ctx).filter(|&j| Some(j) != hide));
    // Sparse decode attention: keep the N highest-scoring positions (ties to the earlier one).
    if let (true, Some(nk)) = (decode, toggles.decode_topk) {
        let nk = nk.get();
        if positions.len() > nk {
            let sc = &*scores;
            positions
                .select_nth_unstable_by(nk - 1, |&a, &b| sc[b].total_cmp(&sc[a]).then(a.cmp(&b)));
            positions.truncate(nk);
            positions.sort_unstable();
        }
    }
    let max = positions
        .iter()
        .fold(f32::NEG_INFINITY, |m, &j| m.max(scores[j]));
    let mut sum = 0.0f32;
    for &j in positions.iter() {
        let p = (scores[j] - max).exp();
        scores[j] = p;
        sum += p;
    }
    out.iter_mut().for_each(|o| *o = 0.0);
    for &j in positions.iter() {
        let p = if bf16 {
            round_bf16(scores[j])
        } else {
            scores[j]
        };
        let vj = kv.v.head(offset(j), hd, bf16, vbuf);
        for (o, &v) in out.iter_mut().zip(vj) {
            *o += p * v;
        }
    }
    let inv = 1.0 / sum;
    out.iter_mut().for_each(|o| *o *= inv);
}
