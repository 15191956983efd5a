//! Misuse gets a clear error or a documented opt-out, never silently wrong gradients: a second
//! forward before backward, two units creating one tensor, `loss.backward()` instead of
//! `FsdpModel::backward`, a second backward or a previous step's output in the loss, group
//! members asking for one tensor in different shapes, and candle-nn's fused layer_norm (no
//! backward) inside a block or as a unit of its own.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_fsdp::comm::threads::{run_ranks, run_ranks_ok, ThreadGroupConfig};
use candle_fsdp::comm::ProcessGroup;
use candle_fsdp::unit::UnitSpec;
use candle_fsdp::{FsdpConfig, FsdpModel};

use crate::user_gpt::{
    assert_parity, batches, builder, full_params, gpt_layout, gpt_program, init_params, make_opt,
    reference, train_step, BlockCfg, Case, Outcome, Params, DM, V,
};

fn three_linears(pg: Arc<dyn ProcessGroup>) -> candle_fsdp::Result<FsdpModel> {
    FsdpModel::builder(pg, FsdpConfig::default())
        .unit("a", |vb| candle_nn::linear(6, 6, vb))
        .unit("b", |vb| candle_nn::linear(6, 6, vb))
        .unit("c", |vb| candle_nn::linear(6, 6, vb))
        .build()
}

#[test]
fn a_second_training_forward_before_backward_is_an_error_unless_discarded() {
    run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut m = three_linears(pg)?;
        let x = Tensor::ones((2, 6), DType::F32, &Device::Cpu)?;
        let _first = m.forward(&x)?;
        let e = m.forward(&x).unwrap_err().to_string();
        assert!(
            e.contains("not back-propagated") && e.contains("discard_forward"),
            "{e}"
        );
        m.discard_forward();
        let y = m.forward(&x)?;
        m.backward(&y.sum_all()?)?;
        Ok(())
    })
    .unwrap();
}

#[test]
fn two_units_creating_the_same_tensor_name_are_rejected() {
    let e = run_ranks_ok(1, ThreadGroupConfig::default(), |pg| {
        FsdpModel::builder(pg, FsdpConfig::default())
            .unit("a", |vb| candle_nn::linear(4, 4, vb.pp("b")))
            .unit("a.b", |vb| candle_nn::linear(4, 4, vb))
            .build()
            .map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("units a and a.b") && e.contains("a.b.weight"),
        "{e}"
    );
}

#[test]
fn a_failed_forward_leaves_no_unit_counted_as_unsharded() {
    let stats = run_ranks_ok(1, ThreadGroupConfig::default(), |pg| {
        let mut m = three_linears(pg)?;
        let bad = Tensor::zeros((2, 5), DType::F32, &Device::Cpu)?;
        assert!(
            m.forward(&bad).is_err(),
            "a (2, 5) input cannot feed Linear(6, 6)"
        );
        let x = Tensor::ones((2, 6), DType::F32, &Device::Cpu)?;
        for _ in 0..3 {
            let y = m.forward(&x)?;
            m.backward(&y.sum_all()?)?;
        }
        Ok(m.memory_stats())
    })
    .unwrap()
    .remove(0);
    assert_eq!(
        (stats.unsharded_units, stats.unsharded_bytes),
        (0, 0),
        "{stats:?}"
    );
    assert!(stats.peak_unsharded_units <= 2, "{stats:?}");
}

// With a GPT written the way Candle users write it (tests/common/user_gpt.rs).

#[test]
fn a_direct_loss_backward_is_an_error_and_the_step_still_works() {
    let c = Case::gpt(2, BlockCfg::default(), false);
    let mut one = c.clone();
    one.steps = 1;
    one.rows = 4;
    let want = reference(&one);
    let got = run_ranks_ok(2, ThreadGroupConfig::default(), move |pg| {
        let r = pg.rank();
        let mut model = builder(&c, pg.clone()).build()?;
        let mut opt = make_opt(false);
        let b: Vec<Tensor> = batches(4, 1)[0]
            .iter()
            .map(|t| t.narrow(0, r * 2, 2))
            .collect::<candle_core::Result<_>>()?;
        let p = c.program.clone();
        let loss = model.forward_with(|f| p(&mut |n, xs| f.call(n, xs), &b, 0))?;
        let e = loss
            .backward()
            .expect_err("loss.backward() must fail")
            .to_string();
        assert!(e.contains("FsdpModel::backward(&loss)"), "{e}");
        // The user fixes the call: the same step still back-propagates correctly.
        model.backward(&loss)?;
        opt.step(&mut model)?;
        full_params(&model)
    })
    .unwrap()
    .remove(0);
    let got = Outcome {
        losses: want.losses.clone(),
        params: got,
    };
    assert_parity(&got, &want, "after a direct loss.backward()");
}

/// This rank's batch of one step: 2 rows.
fn one_rank_batch() -> Vec<Tensor> {
    batches(2, 1).remove(0)
}

#[test]
fn a_second_backward_and_a_stale_output_are_errors_and_the_model_stays_usable() {
    run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let c = Case::gpt(1, BlockCfg::default(), false);
        let mut model = builder(&c, pg.clone()).build()?;
        let b = one_rank_batch();
        let p = c.program.clone();
        let loss = model.forward_with(|f| p(&mut |n, xs| f.call(n, xs), &b, 0))?;
        model.backward(&loss)?;
        let e = model.backward(&loss).unwrap_err().to_string();
        assert!(e.contains("without a preceding training forward"), "{e}");
        model.zero_grad();

        // The output of the previous step in this step's loss.
        let p = c.program.clone();
        let loss2 = model.forward_with(|f| p(&mut |n, xs| f.call(n, xs), &b, 1))?;
        let both = (&loss2 + &loss)?;
        let e = model.backward(&both).unwrap_err().to_string();
        println!("stale output error: {e}");
        // The stale node's own message (it passed before only through a backtrace frame named
        // `FsdpModel::backward` when RUST_BACKTRACE was set).
        assert!(
            e.contains("FsdpModel::backward")
                || e.contains("previous")
                || e.contains("earlier training forward"),
            "{e}"
        );
        // The model is usable afterwards.
        let p = c.program.clone();
        let loss3 = model.forward_with(|f| p(&mut |n, xs| f.call(n, xs), &b, 2))?;
        model.backward(&loss3)?;
        Ok(())
    })
    .unwrap();
}

#[test]
fn group_members_asking_for_one_tensor_in_different_shapes_are_rejected() {
    run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        // The LM head written with in/out swapped: (DM, V) instead of (V, DM).
        let e = FsdpModel::builder(pg.clone(), FsdpConfig::default())
            .group(
                "wte",
                [
                    UnitSpec::new("emb", |vb| candle_nn::embedding(V, DM, vb)),
                    UnitSpec::new("head", |vb| candle_nn::linear_no_bias(V, DM, vb)),
                ],
            )
            .build()
            .err()
            .expect("must fail")
            .to_string();
        assert!(
            e.contains("units emb and head of group wte both ask for wte.weight but with different shapes: [67, 16] and [16, 67]"),
            "{e}"
        );
        Ok(())
    })
    .unwrap();
}

/// The initial parameters of `c` and each rank's full parameters (or error) after 2 AdamW steps
/// at world size 2 on 4-row batches.
fn two_steps_at_ws2(c: &mut Case) -> (Params, Vec<candle_fsdp::Result<Params>>) {
    c.rows = 4;
    c.steps = 2;
    let init = init_params(c);
    let c2 = c.clone();
    let data = batches(c.rows, c.steps);
    let got = run_ranks(2, ThreadGroupConfig::default(), move |pg| {
        let mut model = builder(&c2, pg.clone()).build()?;
        let mut opt = make_opt(false);
        for (s, b) in data.iter().enumerate() {
            train_step(&c2, &mut model, opt.as_mut(), b, s)?;
        }
        full_params(&model)
    });
    (init, got)
}

/// candle-nn's fused layer_norm inside a pre-norm block (the usual way): the block's output is
/// still connected to its input (residual) and its other parameters, so neither of the
/// library's checks fires; ln1/ln2 get no gradient and the gradient through the attention and
/// MLP branches into x is dropped. Expected: a clear error naming the unit.
#[test]
fn candle_nn_layer_norm_inside_a_prenorm_block_is_an_error_naming_the_unit() {
    let mut c = Case::gpt(
        2,
        BlockCfg {
            fused_ln: true,
            ..Default::default()
        },
        false,
    );
    let (init, got) = two_steps_at_ws2(&mut c);
    let e = match &got[0] {
        Ok(params) => {
            let mut frozen: Vec<&String> =
                params.keys().filter(|n| params[*n] == init[*n]).collect();
            frozen.sort();
            panic!("no error: trained 2 steps with candle-nn's layer_norm in blocks h0, h1; parameters that silently never changed: {frozen:?}")
        }
        Err(e) => e.to_string(),
    };
    assert!(e.contains("unit h0") && e.contains("layer_norm"), "{e}");
}

/// The same with candle_nn::ops::softmax_last_dim (fused, no backward) in the attention: q/k
/// get no gradient, silently.
#[test]
#[ignore = "known limit: an operation without backward that consumes no parameter directly (candle_nn::ops::softmax_last_dim after a combined qkv projection) leaves every parameter connected through another path; it cannot be seen in the graph (use candle_nn::ops::softmax)"]
fn fused_softmax_in_attention_is_an_error() {
    let mut c = Case::gpt(
        1,
        BlockCfg {
            fused_softmax: true,
            ..Default::default()
        },
        false,
    );
    let (init, got) = two_steps_at_ws2(&mut c);
    if let Ok(params) = &got[0] {
        let w = &params["h0.attn.weight"];
        let w0 = &init["h0.attn.weight"];
        // Rows 0..2*DM of the (3*DM, DM) qkv weight are q and k.
        let qk_unchanged = w[..2 * DM * DM] == w0[..2 * DM * DM];
        let v_changed = w[2 * DM * DM..] != w0[2 * DM * DM..];
        panic!("no error with softmax_last_dim in block h0: q/k rows of h0.attn.weight unchanged after 2 AdamW steps: {qk_unchanged}, v rows changed: {v_changed}");
    }
}

/// The fused layer_norm as a unit of its own (the case the library documents) is an error
/// naming the unit.
#[test]
fn candle_nn_layer_norm_as_its_own_unit_is_an_error_naming_it() {
    let layout = || {
        let mut l = gpt_layout(1, BlockCfg::default(), false);
        let last = l.len() - 1;
        l[last] = (
            "ln_f".into(),
            vec![UnitSpec::new("ln_f", |vb| {
                candle_nn::layer_norm(DM, 1e-5, vb)
            })],
        );
        l
    };
    let mut c = Case::new(layout, gpt_program(1));
    c.rows = 4;
    let got = run_ranks(2, ThreadGroupConfig::default(), move |pg| {
        let mut model = builder(&c, pg.clone()).build()?;
        let mut opt = make_opt(false);
        let b = batches(4, 1).remove(0);
        train_step(&c, &mut model, opt.as_mut(), &b, 0)
    });
    let e = got[0].as_ref().expect_err("must fail").to_string();
    assert!(
        e.contains("unit ln_f") && e.contains("candle_fsdp::nn::layer_norm"),
        "{e}"
    );
}
