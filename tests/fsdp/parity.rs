//! FSDP training equals plain single-process candle-nn training on the same global batches:
//! same losses and same final parameters (relative error ≤ 1e-5), for world sizes 1–4, every
//! sharding strategy, AdamW and SGD with momentum; and the GPT of tests/common/user_gpt.rs (tied
//! head, activation checkpointing, every strategy) at world sizes 2 and 3 (relative error < 1e-4).

use crate::common;
#[path = "../common/parity.rs"]
pub(crate) mod harness;

use crate::user_gpt::{assert_parity, fsdp, init_params, reference, BlockCfg, Case};
use candle_core::{DType, Device};
use candle_fsdp::comm::threads::{run_ranks_ok, ThreadGroupConfig};
use candle_fsdp::init::{seeded_var_builder, varmap_values};
use candle_fsdp::launch::Launcher;
use candle_fsdp::{FsdpConfig, FsdpModel, ShardingStrategy};
use candle_nn::VarMap;
use common::*;
use harness::{check, Opt, SEED};

#[test]
fn full_shard_adam_matches_single_process_ws1_to_4() {
    for ws in 1..=4 {
        check(
            &Launcher::threads(ws),
            ShardingStrategy::FullShard,
            Opt::Adam,
            true,
        );
    }
}

#[test]
fn full_shard_sgd_momentum_matches_single_process_ws1_to_4() {
    for ws in 1..=4 {
        check(
            &Launcher::threads(ws),
            ShardingStrategy::FullShard,
            Opt::SgdMomentum,
            true,
        );
    }
}

#[test]
fn shard_grad_op_and_no_shard_match_single_process() {
    for ws in [2, 3] {
        check(
            &Launcher::threads(ws),
            ShardingStrategy::ShardGradOp,
            Opt::Adam,
            true,
        );
        check(
            &Launcher::threads(ws),
            ShardingStrategy::NoShard,
            Opt::Adam,
            true,
        );
    }
}

#[test]
fn prefetch_off_matches_single_process() {
    check(
        &Launcher::threads(3),
        ShardingStrategy::FullShard,
        Opt::Adam,
        false,
    );
}

#[test]
fn initial_parameters_equal_the_seeded_single_process_model() {
    let varmap = VarMap::new();
    let vb = seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu);
    reference_model(vb).unwrap();
    let reference = varmap_values(&varmap).unwrap();
    for ws in [1, 3, 4] {
        let gathered = run_ranks_ok(ws, ThreadGroupConfig::default(), |pg| {
            let mut b = FsdpModel::builder(
                pg,
                FsdpConfig {
                    seed: SEED,
                    ..Default::default()
                },
            );
            for u in units() {
                b = b.unit_spec(u);
            }
            let model = b.build()?;
            model.gather_full_params(true)
        })
        .unwrap();
        let params = gathered[0].as_ref().expect("rank 0 gets the parameters");
        assert!(gathered[1..].iter().all(|g| g.is_none()));
        assert_eq!(params.len(), reference.len());
        for (name, t) in params {
            // Bitwise: the same generator fills both.
            assert_eq!(to_vec(t), reference[name], "ws {ws}: {name}");
        }
    }
}

// A GPT written the way Candle users write it (tests/common/user_gpt.rs), against plain Candle on
// the global batch at world sizes 2 and 3.

#[test]
fn a_users_gpt_with_a_tied_head_matches_plain_candle_ws2_ws3() {
    let c = Case::gpt(3, BlockCfg::default(), false);
    let want = reference(&c);
    assert!(
        want.losses[2] < want.losses[0],
        "the reference trains: {:?}",
        want.losses
    );
    let init = init_params(&c);
    assert_ne!(want.params["wte.weight"], init["wte.weight"]);
    for ws in [2, 3] {
        let got = fsdp(&c, ws);
        assert_parity(&got, &want, &format!("gpt ws {ws}"));
        assert!(!got.params.contains_key("emb.weight") && !got.params.contains_key("head.weight"));
    }
}

#[test]
fn a_users_gpt_with_activation_checkpointing_matches_plain_candle() {
    let c = Case::gpt(3, BlockCfg::default(), true);
    let want = reference(&c);
    for ws in [2, 3] {
        assert_parity(
            &fsdp(&c, ws),
            &want,
            &format!("gpt + activation checkpointing ws {ws}"),
        );
    }
}

#[test]
fn a_users_gpt_matches_plain_candle_with_shard_grad_op_and_no_shard() {
    let mut c = Case::gpt(2, BlockCfg::default(), false);
    let want = reference(&c);
    for (s, ws) in [
        (ShardingStrategy::ShardGradOp, 2),
        (ShardingStrategy::NoShard, 2),
        (ShardingStrategy::NoShard, 3),
        (ShardingStrategy::ShardGradOp, 3),
    ] {
        c.strategy = s;
        assert_parity(&fsdp(&c, ws), &want, &format!("{s:?} ws {ws}"));
    }
}
