//! Differentiable layers and fused ops for training: the pieces of a transformer step that
//! Candle either computes without a backward or composes of many small graph nodes.
//!
//! | op | file | what it replaces |
//! |---|---|---|
//! | [`LayerNorm`], [`RmsNorm`] ([`layer_norm`], [`rms_norm`], [`layer_norm_no_bias`]) | `norm.rs` | candle-nn's norms, whose fused kernels have no backward |
//! | [`linear_forward`] ([`Linear`], [`linear`]) | `linear.rs` | `candle_nn::Linear` (reshape, matmul, reshape, broadcast-add: four nodes) |
//! | [`causal_softmax`] ([`causal_softmax_composed`]) | `softmax.rs` | scale + mask + softmax (four nodes) |
//! | [`attention`] ([`attention_composed`], [`AttentionOptions`]: grouped-query heads, scale, sliding window, logit soft-capping; [`attention_packed`]: examples packed in one sequence, [`segment_starts`]; [`causal_attention`], [`causal_attention_gqa`] the plain causal case) | `attention.rs` | the q/k/v split, `Q·Kᵀ`, the scale, soft-cap and mask, the softmax, `·V` and the head merge (about fifteen nodes and a `(B, h, T, T)` score tensor kept for backward) |
//! | [`linear_gelu`] | `linear.rs` | `linear_forward` then `gelu`: two nodes, the second's gradient accumulator the size of the MLP's hidden layer |
//! | [`gelu`] | `activation.rs` | `Tensor::gelu` (single-threaded, one `tanh` per element) |
//! | [`rope`] ([`rope_composed`]) | `rope.rs` | rotary position embeddings as narrows, a negation, a concatenation and two broadcast products (six nodes) |
//! | [`cross_entropy`] | `loss.rs` | `candle_nn::loss::cross_entropy` (log-softmax, gather, mean: a `(N, V)` log-probability tensor) |
//! | [`kernels`]: the same kernels over plain f32 slices (matmul views, norms, attention, rotary, SiLU/GELU, bias sums) | `kernels.rs` | the building blocks of fused nodes ([`crate::fsdp::fused`]): the GPT block (`models/decoder/fused/gpt2.rs`), the decoder families' block (`models/decoder/fused.rs`), users' own |
//!
//! Every op is one graph node whose backward is a hand-written CPU kernel (f32, and bf16/f16
//! where noted, computed in f32), and falls back to the composed Candle ops on other devices and
//! dtypes, with the same values up to rounding. Fewer nodes also mean fewer zero-filled
//! gradient accumulators in Candle's backward (one per node input).
//!
//! **Threads.** A kernel splits its work over rayon's pool when Candle's intra-op thread count
//! (`RAYON_NUM_THREADS`, which [`crate::comm::threads::set_intra_op_threads`] sets to the cores
//! per rank) is above 1, and runs on the calling thread otherwise: in-process ranks are threads,
//! and a kernel that asked a shared pool for every core would queue the ranks behind each other
//! (`crate::cpu`). This is the rule Candle's own matmul follows.

mod activation;
mod attention;
pub mod kernels;
mod linear;
mod loss;
mod norm;
mod rope;
mod softmax;

pub use activation::{gelu, gelu_composed};
pub use attention::{
    attention, attention_composed, attention_packed, attention_packed_composed, causal_attention,
    causal_attention_composed, causal_attention_gqa, causal_attention_gqa_composed, segment_starts,
    AttentionOptions,
};
pub use linear::{linear, linear_forward, linear_gelu, linear_normal, Linear};
pub(crate) use linear::{linear_cpu, linear_grads};
pub use loss::{cross_entropy, cross_entropy_composed, lm_loss, lm_loss_sum, IGNORE_INDEX};
pub use norm::{layer_norm, layer_norm_no_bias, rms_norm, LayerNorm, RmsNorm};
pub use rope::{rope, rope_composed};
pub use softmax::{causal_softmax, causal_softmax_composed};
