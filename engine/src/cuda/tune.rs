//! Tuning knobs for kernel sweeps on a GPU machine, read once from the environment.
//!
//! The device machine has no Rust toolchain and little time, so a sweep (blocks per
//! multiprocessor of the persistent step kernel, the attention split length) must not need a
//! rebuild: the test and bench executables built elsewhere read these variables instead. Unset,
//! every knob keeps the measured default. Values that do not parse are reported once and ignored.
//!
//! - `TAPEDECK_NVRTC_DEFINES=NAME=VALUE,...`: preprocessor definitions for every kernel source
//!   (each kernel's tunable macros are `#ifndef`-guarded: decode_step.cu's `MK_MIN_BLOCKS`,
//!   `MK_DEPTH`, `MK_SWIGLU_DEPTH`, `MK_PHASES`; engine.cu's `SWIGLU_PRE_EARLY`,
//!   `QKV_PRE_EARLY`, `GEMV_PRE_EARLY`: how much of each weight row a GEMV requests before its
//!   PDL wait), e.g. `MK_MIN_BLOCKS=1`. They enter the PTX cache key like any other compile
//!   option.
//! - `TAPEDECK_MMA_SPLIT_MIN=N`: the shortest split of the mma decode kernel's split-K (a
//!   multiple of 64, default 128).
//! - `TAPEDECK_GEMV_SLICE=N`: the longest slice of a weight row one GEMV warp reads (256, 512,
//!   1024, 2048, the default, or 4096): shorter slices spread a row over more warps; 4096 gives
//!   llama-1b's down projection two warps a row (8 KB of weights each, as gate/up has) instead
//!   of four. Measured on an H100 (llama-1b batch-1 decode, seventeenth session): 2048 876 tok/s,
//!   4096 852, 1024 796.
//! - `TAPEDECK_MLP_DROWS=1`: the MLP dataflow grid (`TAPEDECK_FUSE=...,mlp`) gives each down
//!   warp one output feature (4 KB of weights in flight, as the separate down GEMV) instead of
//!   two (8 KB, as a gate/up warp; compiled with `MLP_FLOW_DROWS`). The same bits.
//! - `TAPEDECK_GEMV_BLOCK=4`: the standalone GEMV and gate/up kernels run blocks of 4 warps
//!   instead of 8 (compiled with `GEMV_BLOCK_WARPS=4`): twice the blocks, each half as long, so
//!   a launch's last wave is finer and each SM refills its memory pipe a smaller block at a time.
//!   The same bits (a row's slices are summed in the same order; the fused RMSNorm prologue's
//!   128 threads play the 256 of the rms_norm kernel). Long rows are split over at most 4 warps.
//!   Measured slower (llama-1b batch-1 decode on an H100: 851 against 867 tok/s; Nsight Compute
//!   shows higher occupancy but the same DRAM throughput, eighteenth session).
//! - `TAPEDECK_MMA_MERGE=in-kernel`: merge the mma decode kernel's splits in the mma kernel's last
//!   block per KV head instead of in the separate combine kernel (`kernel`, the default). The
//!   same bits either way; in-kernel measured slower (llama-1b batch-1 decode on the H200: 724
//!   against 852 tok/s; again in the twelfth session with the kernels releasing their PDL
//!   dependents after their KV reads: 738–741 against 842–858, so that was not the cause). Since
//!   the seventeenth session the merging block merges all of its group's heads at once
//!   (`combine_group_fast`; it merged them head after head, three memory waits each): on an
//!   H100, 834–849 against 867–874 tok/s, whether the kernel releases its dependents before the
//!   merge, at its start (`DA_TRIGGER_LATE=0`) or at its exit (`DA_TRIGGER_AFTER_MERGE=1`); at a
//!   4096-token context 684 against 819 (more splits than the fast merge takes).
//!   `TAPEDECK_MMA_MERGE=cluster`: the splits of a KV head run as one thread block cluster
//!   (sm_90+, at most 8 splits, else the combine kernel), which meets at a cluster barrier, and
//!   split 0's block merges them: no counter, no global fence, no combine launch. The same bits
//!   (tested on an H100), but slower: 834 against 867 tok/s (llama-1b batch-1 decode, eighteenth
//!   session).
//! - `TAPEDECK_GEMV_GRID=K`: run the GEMV and gate/up kernels on at most K blocks per SM (1-8),
//!   each looping over its rows with the next row's weights in flight (compiled with
//!   `GEMV_PERSIST=1`), instead of one block per 8 rows (0, the default). A one-wave grid lets the
//!   next kernel's blocks launch at once (PDL) and prefetch their weights beside it.
//! - `TAPEDECK_GEMV_STREAM=K`: one-row GEMVs and gate/up (slices of at most 2048 inputs) on the
//!   streaming kernels (`gemv_stream_bf16_1`, `gemv_stream_swiglu_1`): K blocks per SM (1 or 2)
//!   stay resident and each warp keeps `GEMV_STREAM_DEPTH` (an NVRTC define, default 3) weight
//!   rows in flight, with no block boundary between rows. The same bits as the default kernels
//!   (0: one block per row group). Measured slower (llama-1b batch-1 decode on an H100: 832 tok/s
//!   with 0, 793 with 2, 652 with 1): a resident grid leaves no room for the next kernel's blocks
//!   to launch early (PDL), and alone it streams no faster. Kept for other GPUs' sweeps.
//! - `TAPEDECK_L2_PREFETCH=mlp:N,o,down:N,next,first`: batch-1 GEMV steps ask the L2 for weights
//!   before the kernel that reads them (`l2_prefetch` in kernels/engine.cu, launched with PDL
//!   beside the kernel before): `mlp:N` the first N MB of each layer's gate and up rows (half
//!   each) and `o` its o weights, both during its attention; `down:N` the first N MB of its down
//!   weights during gate/up; `next` the next layer's q/k/v weights during down; `first` layer 0's
//!   q/k/v and o during the head GEMV, for the next step; `blocks:N` the launch's blocks (12).
//!   Unset: none. Only timing changes. Measured slower in every form (llama-1b batch-1 decode on
//!   an H100, docs/benchmarks.md "Sixteenth session"): 833 tok/s without; 619 with `mlp:24,o` on
//!   12 blocks (the kernel lasts as long as its transfer, and the attention waits for it); 804
//!   with `blocks:132` (it ends in 1 µs, but its traffic slows the q/k/v GEMV beside it, and the
//!   GEMVs reading the prefetched rows are no faster).
//! - `TAPEDECK_FUSE=rope,merge,head,mlp`: which fusions `fuse=on` applies (default `rope,head`):
//!   RoPE + KV write in the q/k/v GEMV, the split merge in the o GEMV, the final RMSNorm in the
//!   head's GEMV, gate/up and down as one dataflow grid (1-2 rows; `mlp_flow_N`). All give the
//!   same bits; the knob times each one (llama-1b batch-1 decode on an
//!   H100: `rope,head` 735 tok/s, `rope` 706–723, `rope,merge` 679, no fusion 710; on an H200:
//!   `rope,head` 842–858, no fusion 834–846).
//! - `TAPEDECK_KV_STORAGE=f32`: KV pools store f32 whatever `kv_dtype` says (the values rounded
//!   to it, as before the packed pools), instead of `packed` (the default: bf16 bits for bf16,
//!   FP8 codes + scales for FP8). The same numbers either way; the knob times the storage alone
//!   (`_f32kv` against `_bf16kv` reads) and is a fallback should a packed kernel misbehave.
//! - `TAPEDECK_HOST_COPIES=pinned`: each pass's index upload and picked-token download go
//!   through page-locked host buffers, kept and grown as needed, instead of the pageable
//!   vectors (`pageable`, the default): the driver then copies them by DMA with no staging copy.
//! - `TAPEDECK_GEMV_X_SMEM=off`: the plain GEMV kernels read an input given as is (the o
//!   projection's f32 attention output, down's bf16 SiLU·up product) from global memory in every
//!   warp (compiled with `GEMV_X_SMEM=0`), instead of copying it into shared memory once a block
//!   before summing (`on`, the default; launches get `n · in · 2` bytes of dynamic shared memory
//!   where that fits in 48 KB): the o projection's 256 blocks of 8 warps otherwise ask the L2
//!   for 16 MB of f32 input at the same moment, right after their PDL wait. The same values in
//!   the same order (f32 is rounded to bf16 as the kernel rounds it on the fly): the same bits.
//!   Batch-1 decode on an H100: 911 tok/s with the copy, 876 without (twenty-second session).
//! - `TAPEDECK_MERGE_STAGED=on`: the o GEMV that merges the mma decode kernel's splits itself
//!   (`TAPEDECK_FUSE=...,merge`) first copies every split's partial outputs and (max, sum) pairs
//!   into shared memory by cp.async in one round (compiled with `MERGE_STAGED=1`; the launch then
//!   takes `n · heads · max_splits · (head_dim + 2) · 4` bytes more, up to 72 KB, so the merging
//!   functions' limit is raised), instead of merging them in registers with three waits for L2
//!   after its PDL wait (`off`, the default). The same bits either way. Both lose to the combine
//!   kernel (H100, llama-1b batch-1 decode, twenty-third session): staged 786, registers 812,
//!   the combine 911 tok/s. The staged merge's 76 registers did not pay for its shared memory:
//!   every o block reads all splits (40 KB at 512 tokens) from L2 after its wait.
//! - `TAPEDECK_GEMV_ASYNC=8|16`: the plain GEMV kernels (o, down, the head, and the merging o
//!   GEMV of `fuse=...,merge`) request each warp's first 8 or 16 chunks a lane of weights (4 or
//!   8 KB a warp) into shared memory with cp.async, not into registers (compiled with
//!   `GEMV_ASYNC=1`, `GEMV_STAGE_PRE=N`; every such launch gets `warps · N · 512` more bytes of
//!   dynamic shared memory). Registers, not bytes, limit how many GEMV blocks an SM holds (the
//!   one-row GEMV: 71 registers, 60 staged) and whether the next kernel's blocks fit beside
//!   them; 16 with `TAPEDECK_GEMV_SLICE=4096` gives down two warps a row with all 8 KB each in
//!   flight before the PDL wait. The same bits. Unset or 0: registers.
//! - `TAPEDECK_SWIGLU_ASYNC=on`: the gate/up kernels stage each warp's gate and up rows (8 chunks
//!   a lane of each: 8 KB a warp) in shared memory by cp.async the same way (compiled with
//!   `SWIGLU_ASYNC=1`; launches get `warps · 8 KB` more): 96 → 54 registers for one row, so the
//!   down blocks after them fit beside their last wave, and the shared memory, not the
//!   registers, decides how many gate/up blocks an SM holds. The same bits.
//! - `TAPEDECK_QKV_ASYNC=on`: the fused q/k/v + RoPE kernels (`fuse=on`) stage each warp's two
//!   rows the same way (compiled with `QKV_ASYNC=1`; launches get `warps · 8 KB` more). With the
//!   kernel macro `GEMV_TMA=1` all three kinds of staging (`TAPEDECK_GEMV_ASYNC=8`,
//!   `TAPEDECK_SWIGLU_ASYNC=on`, this) copy a warp's rows by bulk copies of the copy engine
//!   (sm_90+), which leave the SM's load pipeline to the input read after the PDL wait.
//! - `TAPEDECK_RUN_AHEAD=off`: `Engine::generate` waits for each decode step's token before
//!   submitting the next (`on`, the default: the next step is enqueued first and reads the token
//!   on the device, so the host's work between steps overlaps the step). The same tokens either
//!   way; the knob times the overlap.
//! - `TAPEDECK_PDL_ATTN=off`: under `pdl=on`, the mma decode kernel and its split combine are
//!   launched with PDL too (`on`, the default since the twenty-sixth session), as `pdl=all`
//!   launches them (the other kernels `pdl=all` adds are left as they are). With the kernel
//!   macro `DA_KV_EARLY=1` (the default with it: the attention stages its cached KV before it
//!   waits, while the q/k/v GEMV still runs) llama-1b batch-1 decode on an H100 went 930 → 938
//!   tok/s (twenty-sixth session, call 1); `off` times the attention launched after the GEMV.
//! - `TAPEDECK_PDL_PICKS=on`: under `pdl=on`, the token picks after the head (`pick_partial`,
//!   `pick_finish`) are launched with PDL too, as `pdl=all` launches them: each then starts while
//!   the kernel before it drains instead of ~1.1 µs after it ended (the twenty-fifth session's
//!   trace: 12 µs a step from the head's end to the picks'). Only timing changes.
//! - `TAPEDECK_EMBED_FUSED=on`: a one-row decode pass with the fused q/k/v kernel (`fuse=on`,
//!   the GEMV path) has no `embed_tokens` launch: the first layer's q/k/v kernel reads the token's
//!   embedding row itself and writes it to the residual stream (`gemv_bf16_qkv_rope*_embed_1`). The
//!   same bits; only timing changes (the embedding kernel and its boundary cost ~5 µs from the
//!   step's start to the first GEMV's input in the twenty-fifth session's trace).
//! - `TAPEDECK_SMEM_CARVEOUT=P` (0-100): every kernel's preferred shared-memory carveout, the
//!   percentage of the SM's unified L1/shared memory given to shared memory
//!   (`CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT`). Unset: the driver picks one per
//!   kernel from its needs. Written to test whether consecutive kernels given different
//!   carveouts (the GEMVs, a few KB of shared memory; the mma attention, 64 KB a block) wait for
//!   SMs to drain between them. Measured slower at every value (llama-1b batch-1 decode on an
//!   H100, twenty-first session: 805 / 815 / 709 tok/s at 100 / 50 / 0 against 879): the
//!   driver's per-kernel choice stays. Only timing changes.
//! - `TAPEDECK_TRACE=path`: compile the kernels with `TD_TRACE=1` and record a per-block timeline
//!   of every launch (cuda/trace.rs), saved to `path` as CSV by `bench engine`.

use std::sync::OnceLock;

/// Which kernel fusions `fuse=on` applies (see `TAPEDECK_FUSE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Fusions {
    /// RoPE and the KV write in the q/k/v GEMV's epilogue.
    pub rope: bool,
    /// The mma kernel's split merge in the o GEMV's prologue.
    pub merge: bool,
    /// The final RMSNorm in the head GEMV's prologue.
    pub head: bool,
    /// gate/up and down in one dataflow grid (`mlp_flow_N` in kernels/engine.cu).
    pub mlp: bool,
}

impl Fusions {
    /// No fusion (`fuse=off`).
    pub const NONE: Fusions = Fusions {
        rope: false,
        merge: false,
        head: false,
        mlp: false,
    };
    /// What `fuse=on` applies unless `TAPEDECK_FUSE` says otherwise.
    const DEFAULT: Fusions = Fusions {
        rope: true,
        merge: false,
        head: true,
        mlp: false,
    };

    fn parse(list: Option<&str>) -> Fusions {
        let Some(list) = list else {
            return Fusions::DEFAULT;
        };
        let mut f = Fusions::NONE;
        for part in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            match part {
                "rope" => f.rope = true,
                "merge" => f.merge = true,
                "head" => f.head = true,
                "mlp" => f.mlp = true,
                other => {
                    tracing::warn!("TAPEDECK_FUSE: ignoring {other:?} (rope, merge, head, mlp)")
                }
            }
        }
        f
    }
}

/// Which weights batch-1 GEMV steps prefetch into the L2 (see `TAPEDECK_L2_PREFETCH`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct L2Prefetch {
    /// Bytes of each layer's gate/up weights (half from each) requested after its q/k/v GEMV.
    pub mlp_bytes: usize,
    /// Each layer's o weights, requested with them.
    pub o: bool,
    /// Bytes of each layer's down weights requested after its o GEMV.
    pub down_bytes: usize,
    /// The next layer's q/k/v weights, requested after each gate/up GEMV.
    pub next: bool,
    /// Layer 0's q/k/v and o weights, requested after the head GEMV for the next step.
    pub first: bool,
    /// Blocks of the prefetch launch: each SM's copy engine issues its share of the pieces, so
    /// few blocks make the kernel (which the next one waits for) last as long as the transfer.
    pub blocks: usize,
}

impl Default for L2Prefetch {
    fn default() -> L2Prefetch {
        L2Prefetch {
            mlp_bytes: 0,
            o: false,
            down_bytes: 0,
            next: false,
            first: false,
            blocks: 12,
        }
    }
}

impl L2Prefetch {
    fn parse(list: Option<&str>) -> L2Prefetch {
        let mut p = L2Prefetch::default();
        for part in list.unwrap_or_default().split(',').map(str::trim) {
            match part {
                "" => {}
                "o" => p.o = true,
                "first" => p.first = true,
                "next" => p.next = true,
                _ => {
                    let mb = |prefix: &str| {
                        let n = part.strip_prefix(prefix)?.trim().parse::<usize>().ok()?;
                        (n <= 256).then_some(n << 20)
                    };
                    let blocks = part
                        .strip_prefix("blocks:")
                        .and_then(|n| n.trim().parse::<usize>().ok())
                        .filter(|n| (1..=1024).contains(n));
                    match (mb("mlp:"), mb("down:"), blocks) {
                        (Some(b), _, _) => p.mlp_bytes = b,
                        (_, Some(b), _) => p.down_bytes = b,
                        (_, _, Some(n)) => p.blocks = n,
                        _ => tracing::warn!(
                            "TAPEDECK_L2_PREFETCH: ignoring {part:?} \
                             (mlp:MB, down:MB up to 256, o, next, first, blocks:1-1024)"
                        ),
                    }
                }
            }
        }
        p
    }

    /// Whether any prefetch is asked for.
    pub fn any(&self) -> bool {
        self.mlp_bytes > 0 || self.o || self.down_bytes > 0 || self.next || self.first
    }
}

/// The knobs in effect for this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Tuning {
    /// `-D` options added to every NVRTC compile.
    pub nvrtc_defines: Vec<String>,
    /// The mma decode kernel's shortest split, in positions.
    pub split_min: usize,
    /// The fusions of `fuse=on`.
    pub fuse: Fusions,
    /// Where to save the kernel timeline, when tracing.
    pub trace: Option<std::path::PathBuf>,
    /// Blocks per SM of the GEMV kernels' persistent grid, 0 for one block per row group.
    pub gemv_grid: usize,
    /// Blocks per SM of the streaming one-row GEMV kernels, 0 for the default kernels.
    pub gemv_stream: usize,
    /// The GEMV kernels' longest slice per warp, in inputs.
    pub gemv_slice: usize,
    /// Warps per block of the standalone GEMV and gate/up kernels (4 or 8).
    pub gemv_block: usize,
    /// Output features per down warp of the MLP dataflow grid (1 or 2).
    pub mlp_drows: usize,
    /// Where the mma decode kernel's splits are merged.
    pub mma_merge: MmaMerge,
    /// KV pools store f32 for every `kv_dtype` (`TAPEDECK_KV_STORAGE=f32`).
    pub kv_f32: bool,
    /// The per-pass index upload and token download go through page-locked host buffers
    /// (`TAPEDECK_HOST_COPIES=pinned`).
    pub pinned: bool,
    /// `generate` enqueues each decode step before reading the one in flight back
    /// (`TAPEDECK_RUN_AHEAD`, default on).
    pub run_ahead: bool,
    /// L2 prefetches of weights in batch-1 GEMV steps.
    pub l2_prefetch: L2Prefetch,
    /// The mma decode kernel and its combine launch with PDL under `pdl=on` (`TAPEDECK_PDL_ATTN`,
    /// on unless `off`).
    pub pdl_attn: bool,
    /// The token picks launch with PDL under `pdl=on` (`TAPEDECK_PDL_PICKS=on`; off by default).
    pub pdl_picks: bool,
    /// The first layer's one-row q/k/v kernel gathers the embedding (`TAPEDECK_EMBED_FUSED=on`).
    pub embed_fused: bool,
    /// Every kernel's preferred shared-memory carveout in percent (`TAPEDECK_SMEM_CARVEOUT`);
    /// `None` leaves it to the driver.
    pub smem_carveout: Option<u32>,
    /// The plain GEMVs stage an as-given input in shared memory (`TAPEDECK_GEMV_X_SMEM`, on unless
    /// `off`).
    pub gemv_x_smem: bool,
    /// The merging o GEMV (`TAPEDECK_FUSE=...,merge`) stages the splits in shared memory by
    /// cp.async before merging (`TAPEDECK_MERGE_STAGED=on`; off by default).
    pub merge_staged: bool,
    /// Chunks a lane the plain GEMVs stage in shared memory through cp.async, 0 for registers
    /// (`TAPEDECK_GEMV_ASYNC`).
    pub gemv_async: usize,
    /// The gate/up kernels stage their weights in shared memory (`TAPEDECK_SWIGLU_ASYNC=on`).
    pub swiglu_async: bool,
    /// The fused q/k/v kernels stage their weights in shared memory (`TAPEDECK_QKV_ASYNC=on`).
    pub qkv_async: bool,
}

impl Tuning {
    /// The dynamic shared memory a plain GEMV launch of `warps`-warp blocks adds for its staged
    /// weights (`TAPEDECK_GEMV_ASYNC`; 0 when off): 16 bytes a chunk.
    pub fn gemv_stage_bytes(&self, warps: usize) -> usize {
        warps * self.gemv_async * 32 * 16
    }

    /// The same for a gate/up launch (`TAPEDECK_SWIGLU_ASYNC`): two rows a warp, each what a
    /// warp prefetches (`GEMV_SLICE` bf16 inputs).
    pub fn swiglu_stage_bytes(&self, warps: usize) -> usize {
        two_rows_a_warp(self.swiglu_async, warps)
    }

    /// The same for a fused q/k/v launch (`TAPEDECK_QKV_ASYNC`): a warp's rotary pair of rows.
    pub fn qkv_stage_bytes(&self, warps: usize) -> usize {
        two_rows_a_warp(self.qkv_async, warps)
    }
}

/// Two prefetched rows (`GEMV_SLICE` bf16 inputs each) a warp, when `staged`.
fn two_rows_a_warp(staged: bool, warps: usize) -> usize {
    if staged {
        warps * 2 * super::linears::GEMV_SLICE * 2
    } else {
        0
    }
}

/// The default split floor. The engine's pool holds f32 (the `_f32kv` kernel, one tile in flight
/// per warp), where more, shorter splits pay at short contexts: llama-1b batch-1 decode at 576
/// positions ran 834 / 855 / 847 tok/s with 256 / 128 / 64 (H200). The standalone bf16-KV sweeps
/// (docs/cuda_decode_attention.md) chose 256.
const SPLIT_MIN: usize = 128;

impl Tuning {
    /// The knobs from `var` (the environment, or a test's map).
    fn parse(var: impl Fn(&str) -> Option<String>) -> Tuning {
        let fuse = Fusions::parse(var("TAPEDECK_FUSE").as_deref());
        let trace = var("TAPEDECK_TRACE")
            .filter(|p| !p.trim().is_empty())
            .map(std::path::PathBuf::from);
        let mut nvrtc_defines = Vec::new();
        for d in var("TAPEDECK_NVRTC_DEFINES")
            .unwrap_or_default()
            .split(',')
            .filter(|d| !d.trim().is_empty())
        {
            let d = d.trim();
            let ok = d.split_once('=').is_some_and(|(name, value)| {
                !name.is_empty()
                    && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                    && value
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c))
            });
            if ok {
                nvrtc_defines.push(format!("-D{d}"));
            } else {
                tracing::warn!("TAPEDECK_NVRTC_DEFINES: ignoring {d:?} (want NAME=VALUE)");
            }
        }
        let split_min = number(
            &var,
            "TAPEDECK_MMA_SPLIT_MIN",
            SPLIT_MIN,
            |n| n >= 64 && n.is_multiple_of(64),
            "a multiple of 64",
        );
        let gemv_slice = number(
            &var,
            "TAPEDECK_GEMV_SLICE",
            super::linears::GEMV_SLICE,
            |n| [256, 512, 1024, 2048, 4096].contains(&n),
            "256, 512, 1024, 2048 or 4096",
        );
        let gemv_grid = number(
            &var,
            "TAPEDECK_GEMV_GRID",
            0,
            |n| n <= 8,
            "0 to 8 blocks per SM",
        );
        let gemv_stream = number(
            &var,
            "TAPEDECK_GEMV_STREAM",
            0,
            |n| n <= 2,
            "0, 1 or 2 blocks per SM",
        );
        let gemv_block = number(
            &var,
            "TAPEDECK_GEMV_BLOCK",
            8,
            |n| n == 4 || n == 8,
            "4 or 8",
        );
        let mlp_drows = number(
            &var,
            "TAPEDECK_MLP_DROWS",
            2,
            |n| n == 1 || n == 2,
            "1 or 2",
        );
        if gemv_grid > 0 {
            nvrtc_defines.push("-DGEMV_PERSIST=1".into());
        }
        if mlp_drows != 2 {
            nvrtc_defines.push(format!("-DMLP_FLOW_DROWS={mlp_drows}"));
        }
        if gemv_block != 8 {
            nvrtc_defines.push(format!("-DGEMV_BLOCK_WARPS={gemv_block}"));
        }
        if trace.is_some() {
            nvrtc_defines.push("-DTD_TRACE=1".into());
        }
        let gemv_async = number(
            &var,
            "TAPEDECK_GEMV_ASYNC",
            0,
            |n| [0, 8, 16].contains(&n),
            "0, 8 or 16 chunks a lane",
        );
        if gemv_async > 0 {
            nvrtc_defines.push("-DGEMV_ASYNC=1".into());
            nvrtc_defines.push(format!("-DGEMV_STAGE_PRE={gemv_async}"));
        }
        let swiglu_async = second(&var, "TAPEDECK_SWIGLU_ASYNC", ["off", "on"]);
        if swiglu_async {
            nvrtc_defines.push("-DSWIGLU_ASYNC=1".into());
        }
        let qkv_async = second(&var, "TAPEDECK_QKV_ASYNC", ["off", "on"]);
        if qkv_async {
            nvrtc_defines.push("-DQKV_ASYNC=1".into());
        }
        let gemv_x_smem = !second(&var, "TAPEDECK_GEMV_X_SMEM", ["on", "off"]);
        if !gemv_x_smem {
            nvrtc_defines.push("-DGEMV_X_SMEM=0".into());
        }
        let merge_staged = second(&var, "TAPEDECK_MERGE_STAGED", ["off", "on"]);
        if merge_staged {
            nvrtc_defines.push("-DMERGE_STAGED=1".into());
        }
        let mma_merge = [MmaMerge::Kernel, MmaMerge::InKernel, MmaMerge::Cluster][choice(
            &var,
            "TAPEDECK_MMA_MERGE",
            &["kernel", "in-kernel", "cluster"],
        )];
        let kv_f32 = second(&var, "TAPEDECK_KV_STORAGE", ["packed", "f32"]);
        let pinned = second(&var, "TAPEDECK_HOST_COPIES", ["pageable", "pinned"]);
        let run_ahead = !second(&var, "TAPEDECK_RUN_AHEAD", ["on", "off"]);
        let pdl_attn = !second(&var, "TAPEDECK_PDL_ATTN", ["on", "off"]);
        let pdl_picks = second(&var, "TAPEDECK_PDL_PICKS", ["off", "on"]);
        let embed_fused = second(&var, "TAPEDECK_EMBED_FUSED", ["off", "on"]);
        let smem_carveout =
            var("TAPEDECK_SMEM_CARVEOUT").and_then(|v| match v.trim().parse::<u32>() {
                Ok(p) if p <= 100 => Some(p),
                _ => {
                    tracing::warn!("TAPEDECK_SMEM_CARVEOUT: want a percentage 0-100, not {v:?}");
                    None
                }
            });
        Tuning {
            nvrtc_defines,
            split_min,
            fuse,
            trace,
            gemv_grid,
            gemv_stream,
            gemv_slice,
            gemv_block,
            mlp_drows,
            mma_merge,
            kv_f32,
            pinned,
            run_ahead,
            l2_prefetch: L2Prefetch::parse(var("TAPEDECK_L2_PREFETCH").as_deref()),
            pdl_attn,
            pdl_picks,
            embed_fused,
            smem_carveout,
            gemv_x_smem,
            merge_staged,
            gemv_async,
            swiglu_async,
            qkv_async,
        }
    }
}

/// Whether variable `name` (read through `var`) names the second of its two values: unset or
/// anything else (with a warning) is the first, the default.
fn second(var: impl Fn(&str) -> Option<String>, name: &str, values: [&str; 2]) -> bool {
    choice(var, name, &values) == 1
}

/// Which of `values` variable `name` (read through `var`) names, by index: unset or anything
/// else (with a warning) is the first, the default.
fn choice(var: impl Fn(&str) -> Option<String>, name: &str, values: &[&str]) -> usize {
    match var(name).as_deref().map(str::trim) {
        None => 0,
        Some(v) => values.iter().position(|&w| w == v).unwrap_or_else(|| {
            tracing::warn!("{name}: want one of {}, not {v:?}", values.join(", "));
            0
        }),
    }
}

/// Where the mma decode kernel's splits are merged (`TAPEDECK_MMA_MERGE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum MmaMerge {
    /// The separate combine kernel.
    #[default]
    Kernel,
    /// The mma kernel's last block per KV head (a counter in global memory).
    InKernel,
    /// Split 0's block of a thread block cluster holding the KV head's splits (sm_90+, at most 8
    /// splits; the combine kernel otherwise).
    Cluster,
}

/// Variable `name`'s number (read through `var`), `default` when unset or not one that `ok`
/// accepts (`want` says which are, in the warning).
fn number(
    var: impl Fn(&str) -> Option<String>,
    name: &str,
    default: usize,
    ok: impl Fn(usize) -> bool,
    want: &str,
) -> usize {
    match var(name).map(|v| v.trim().parse::<usize>()) {
        None => default,
        Some(Ok(n)) if ok(n) => n,
        Some(_) => {
            tracing::warn!("{name}: want {want}; using {default}");
            default
        }
    }
}

/// The process's knobs (the environment is read on first use).
pub(crate) fn get() -> &'static Tuning {
    static T: OnceLock<Tuning> = OnceLock::new();
    T.get_or_init(|| Tuning::parse(|name| std::env::var(name).ok()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(vars: &[(&str, &str)]) -> Tuning {
        Tuning::parse(|name| {
            vars.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn unset_knobs_keep_the_defaults_and_bad_values_are_ignored() {
        assert_eq!(
            parse(&[]),
            Tuning {
                nvrtc_defines: vec![],
                split_min: 128,
                fuse: Fusions::DEFAULT,
                trace: None,
                gemv_grid: 0,
                gemv_stream: 0,
                gemv_slice: 2048,
                gemv_block: 8,
                mlp_drows: 2,
                mma_merge: MmaMerge::Kernel,
                kv_f32: false,
                pinned: false,
                run_ahead: true,
                l2_prefetch: L2Prefetch::default(),
                pdl_attn: true,
                pdl_picks: false,
                embed_fused: false,
                smem_carveout: None,
                gemv_x_smem: true,
                merge_staged: false,
                gemv_async: 0,
                swiglu_async: false,
                qkv_async: false,
            }
        );
        let t = parse(&[
            (
                "TAPEDECK_NVRTC_DEFINES",
                "MK_MIN_BLOCKS=1, X=2.5,bad,Y=a b,=3",
            ),
            ("TAPEDECK_MMA_SPLIT_MIN", "96"),
            ("TAPEDECK_GEMV_SLICE", "100"),
            ("TAPEDECK_MMA_MERGE", "in-kernel"),
            ("TAPEDECK_GEMV_GRID", "9"),
            ("TAPEDECK_KV_STORAGE", "fp16"),
            ("TAPEDECK_GEMV_STREAM", "3"),
        ]);
        assert_eq!(t.nvrtc_defines, ["-DMK_MIN_BLOCKS=1", "-DX=2.5"]);
        assert_eq!(t.split_min, 128, "96 is not a multiple of 64");
        assert_eq!(t.gemv_slice, 2048, "100 is not a slice length");
        assert_eq!(t.gemv_grid, 0, "9 blocks per SM is out of range");
        assert_eq!(t.mma_merge, MmaMerge::InKernel);
        let cluster = parse(&[("TAPEDECK_MMA_MERGE", "cluster")]).mma_merge;
        assert_eq!(cluster, MmaMerge::Cluster);
        let bad = parse(&[("TAPEDECK_MMA_MERGE", "clusters")]).mma_merge;
        assert_eq!(bad, MmaMerge::Kernel);
        assert_eq!(t.gemv_stream, 0, "3 blocks per SM would not fit");
        assert_eq!(parse(&[("TAPEDECK_GEMV_STREAM", "2")]).gemv_stream, 2);
        assert!(!t.kv_f32, "fp16 is not a storage choice");
        assert!(parse(&[("TAPEDECK_KV_STORAGE", "f32")]).kv_f32);
        assert!(parse(&[("TAPEDECK_HOST_COPIES", " pinned")]).pinned);
        assert!(!parse(&[("TAPEDECK_HOST_COPIES", "locked")]).pinned);
        assert!(!parse(&[("TAPEDECK_RUN_AHEAD", "off")]).run_ahead);
        assert!(!parse(&[("TAPEDECK_PDL_ATTN", "off")]).pdl_attn);
        assert!(parse(&[("TAPEDECK_PDL_PICKS", "on")]).pdl_picks);
        assert!(parse(&[("TAPEDECK_EMBED_FUSED", "on")]).embed_fused);
        assert!(
            parse(&[("TAPEDECK_PDL_ATTN", "of")]).pdl_attn,
            "a typo keeps the default"
        );
        assert_eq!(
            parse(&[("TAPEDECK_SMEM_CARVEOUT", "100")]).smem_carveout,
            Some(100)
        );
        assert_eq!(
            parse(&[("TAPEDECK_SMEM_CARVEOUT", "101")]).smem_carveout,
            None
        );
        assert_eq!(parse(&[("TAPEDECK_MMA_SPLIT_MIN", "64")]).split_min, 64);
        assert_eq!(parse(&[("TAPEDECK_GEMV_SLICE", "512")]).gemv_slice, 512);
        let grid = parse(&[("TAPEDECK_GEMV_GRID", "2")]);
        assert_eq!(grid.gemv_grid, 2);
        assert_eq!(
            grid.nvrtc_defines,
            ["-DGEMV_PERSIST=1"],
            "the loop is compiled in"
        );
        let f = parse(&[("TAPEDECK_FUSE", "head, rope,nonsense")]).fuse;
        assert_eq!((f.rope, f.merge, f.head, f.mlp), (true, false, true, false));
        assert!(parse(&[("TAPEDECK_FUSE", "mlp")]).fuse.mlp);
        assert_eq!(parse(&[("TAPEDECK_FUSE", "")]).fuse, Fusions::NONE);
        let traced = parse(&[("TAPEDECK_TRACE", "/tmp/t.csv")]);
        assert_eq!(
            traced.trace.as_deref(),
            Some(std::path::Path::new("/tmp/t.csv"))
        );
        assert_eq!(traced.nvrtc_defines, ["-DTD_TRACE=1"]);
        let unstaged = parse(&[("TAPEDECK_GEMV_X_SMEM", "off")]);
        assert!(!unstaged.gemv_x_smem);
        assert_eq!(
            unstaged.nvrtc_defines,
            ["-DGEMV_X_SMEM=0"],
            "the copy is compiled out"
        );
        assert!(parse(&[("TAPEDECK_GEMV_X_SMEM", "no")]).gemv_x_smem);
        let staged_merge = parse(&[("TAPEDECK_MERGE_STAGED", "on")]);
        assert!(staged_merge.merge_staged);
        assert_eq!(staged_merge.nvrtc_defines, ["-DMERGE_STAGED=1"]);
        assert!(!parse(&[("TAPEDECK_MERGE_STAGED", "off")]).merge_staged);
        let staged = parse(&[("TAPEDECK_GEMV_ASYNC", "16")]);
        assert_eq!(
            staged.nvrtc_defines,
            ["-DGEMV_ASYNC=1", "-DGEMV_STAGE_PRE=16"]
        );
        assert_eq!(staged.gemv_stage_bytes(8), 64 << 10);
        let off = parse(&[("TAPEDECK_GEMV_ASYNC", "12")]);
        assert_eq!(
            (off.gemv_async, off.gemv_stage_bytes(8)),
            (0, 0),
            "12 is not a depth"
        );
        assert_eq!(off.swiglu_stage_bytes(8), 0);
        let gate_up = parse(&[("TAPEDECK_SWIGLU_ASYNC", "on")]);
        assert_eq!(gate_up.nvrtc_defines, ["-DSWIGLU_ASYNC=1"]);
        let qkv = parse(&[("TAPEDECK_QKV_ASYNC", "on")]);
        assert_eq!(qkv.nvrtc_defines, ["-DQKV_ASYNC=1"]);
        assert_eq!(
            (qkv.qkv_stage_bytes(8), qkv.swiglu_stage_bytes(8)),
            (64 << 10, 0)
        );
        assert_eq!(gate_up.swiglu_stage_bytes(8), 64 << 10);
        let p = parse(&[(
            "TAPEDECK_L2_PREFETCH",
            "mlp:24, first,mlp:x,o2,down:8,blocks:0",
        )])
        .l2_prefetch;
        assert_eq!((p.mlp_bytes, p.o, p.first), (24 << 20, false, true));
        assert_eq!(p.blocks, 12, "0 blocks is out of range");
        assert_eq!((p.down_bytes, p.next), (8 << 20, false));
        assert!(p.any());
        let p = parse(&[("TAPEDECK_L2_PREFETCH", "o,blocks:132")]).l2_prefetch;
        assert_eq!((p.o, p.blocks), (true, 132));
        assert!(!parse(&[("TAPEDECK_L2_PREFETCH", "mlp:0,mlp:999")])
            .l2_prefetch
            .any());
    }
}
