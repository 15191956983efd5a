//! Dropout in a user's model (attention dropout in the GPT of tests/common/user_gpt.rs): training
//! with it lowers the loss; a seed reproducing it is a known gap (ignored with the reason).
//! Dropout under free/refill and activation checkpointing: `refill.rs`.

use crate::user_gpt::{fsdp, BlockCfg, Case, SEED};

#[test]
fn attention_dropout_trains_with_falling_loss() {
    let mut c = Case::gpt(
        2,
        BlockCfg {
            dropout: 0.1,
            ..Default::default()
        },
        false,
    );
    c.steps = 5;
    let got = fsdp(&c, 2);
    println!("dropout losses {:?}", got.losses);
    assert!(got.losses.iter().all(|l| l.is_finite()));
    assert!(got.losses[4] < got.losses[0], "{:?}", got.losses);
}

#[test]
#[ignore = "no way to seed dropout: candle's CPU RNG cannot be seeded (Device::set_seed fails) and FsdpConfig::seed only covers init; two runs with the same seed differ"]
fn dropout_is_deterministic_per_seed() {
    let c = Case::gpt(
        2,
        BlockCfg {
            dropout: 0.1,
            ..Default::default()
        },
        false,
    );
    let a = fsdp(&c, 2);
    let b = fsdp(&c, 2);
    assert_eq!(a.losses, b.losses, "two runs with seed {SEED}");
}
