//! The layers and fused ops of `candle_fsdp::nn`, one module per family, each against the
//! composed Candle ops it replaces (values and gradients) and, where written out, an f64
//! reference independent of the crate.
//!
//! - `norms`: LayerNorm / RMSNorm against candle-nn's and composed references, inside FSDP.
//! - `softmax_linear`: the causal softmax and the one-node linear layer.
//! - `fused`: causal attention (against the composed ops and a direct f64 reference), GELU,
//!   cross-entropy and the vectorised exponential.
//! - `attention_options`: attention's scale, sliding window, logit soft-capping and grouped
//!   heads, every combination, against a direct f64 reference and the composed ops.
//! - `matmul`: the crate's strided product against a direct f64 one, and its bounds checks.

mod attention_options;
mod fused;
mod matmul;
mod norms;
mod softmax_linear;
