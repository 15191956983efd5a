//! Reference models used by the examples, tests and benchmarks, written as FSDP units: the
//! MNIST MLP (cargo feature `mnist`) and the one decoder of the Hugging Face families
//! ([`decoder`]: Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, GPT-2; cargo feature `llama`),
//! with the configs a from-scratch run chooses: [`gpt`] (the GPT example's GPT-2, cargo feature
//! `gpt`) and [`llama`].

#[cfg(feature = "llama")]
pub mod decoder;
#[cfg(feature = "gpt")]
pub mod gpt;
#[cfg(feature = "llama")]
pub mod llama;

#[cfg(feature = "mnist")]
use candle_nn::Activation;

#[cfg(feature = "mnist")]
use crate::unit::UnitSpec;

/// The seed recipe's MNIST MLP as four units: `flatten` (no parameters: (B, 1, 28, 28) →
/// (B, 784)), `fc1` Linear(784, 128) + ReLU, `fc2` Linear(128, 64) + ReLU, `fc3`
/// Linear(64, 10) → logits (B, 10), f32. Parameters are named `fc1.weight`, `fc1.bias`, …
/// (candle-nn's `linear` names and init); each linear layer is [`crate::fsdp::fused::Linear`]:
/// one graph node, and inside the runtime one whose parameters need no per-step copies.
#[cfg(feature = "mnist")]
pub fn mnist_mlp() -> Vec<UnitSpec> {
    vec![
        UnitSpec::new("flatten", |_vb| Ok(candle_nn::func(|x| x.flatten_from(1)))),
        UnitSpec::new("fc1", |vb| {
            Ok(candle_nn::seq()
                .add(crate::fsdp::fused::linear(784, 128, vb)?)
                .add(Activation::Relu))
        }),
        UnitSpec::new("fc2", |vb| {
            Ok(candle_nn::seq()
                .add(crate::fsdp::fused::linear(128, 64, vb)?)
                .add(Activation::Relu))
        }),
        UnitSpec::new("fc3", |vb| crate::fsdp::fused::linear(64, 10, vb)),
    ]
}
