//! Frozen parameters (`FsdpModelBuilder::freeze`) in a user's GPT (tests/common/user_gpt.rs):
//! a whole unit, parts of units, the tied embedding, all but one tensor frozen train like plain
//! Candle with those variables left out of the optimizer, frozen ones never change and every
//! trainable one does; a pattern that matches nothing is an error naming it. Frozen parameters
//! with any forward and their optimizer state: `any_forward.rs`.

use candle_fsdp::comm::threads::{run_ranks_ok, ThreadGroupConfig};
use candle_fsdp::optim::glob_match;

use crate::user_gpt::{assert_parity, builder, fsdp, init_params, reference, BlockCfg, Case};

#[test]
fn frozen_units_parts_and_tied_weights_match_plain_candle_and_never_change() {
    let base = Case::gpt(2, BlockCfg::default(), false);
    let init = init_params(&base);
    let all: Vec<String> = init.keys().cloned().collect();
    for (what, freeze, keep) in [
        ("whole unit h0", vec!["h0.*"], None),
        ("part of units", vec!["h*.ln1.*", "h1.attn.weight"], None),
        ("tied embedding", vec!["wte.weight"], None),
        (
            "all but ln_f.bias",
            vec!["wte.*", "wpe.*", "h*", "ln_f.weight"],
            Some("ln_f.bias"),
        ),
    ] {
        let mut c = base.clone();
        c.freeze = freeze.iter().map(|s| s.to_string()).collect();
        let want = reference(&c);
        let got = fsdp(&c, 2);
        assert_parity(&got, &want, &format!("freeze {what}"));
        for n in &all {
            let frozen = c.freeze.iter().any(|p| glob_match(p, n));
            if frozen {
                assert_eq!(got.params[n], init[n], "{what}: frozen {n} changed");
            } else {
                assert_ne!(got.params[n], init[n], "{what}: trainable {n} unchanged");
            }
        }
        if let Some(k) = keep {
            assert_ne!(got.params[k], init[k]);
        }
    }
}

#[test]
fn a_freeze_pattern_matching_nothing_is_an_error_naming_it() {
    run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        let mut c = Case::gpt(1, BlockCfg::default(), false);
        c.freeze = vec!["h0.ln_1.*".into()];
        let e = builder(&c, pg)
            .build()
            .err()
            .expect("a typo must fail")
            .to_string();
        assert!(
            e.contains("h0.ln_1.*")
                && e.contains("matches no parameter")
                && e.contains("h0.ln1.weight"),
            "{e}"
        );
        Ok(())
    })
    .unwrap();
}
