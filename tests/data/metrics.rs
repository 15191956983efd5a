//! The classification metric (`candle_fsdp::metrics`, cargo feature `mnist`) on a gathered model.

use candle_core::{Device, Tensor};
use candle_fsdp::comm::threads::{run_ranks_ok, ThreadGroupConfig};
use candle_fsdp::metrics::accuracy;
use candle_fsdp::{FsdpConfig, FsdpModel};

#[test]
fn accuracy_counts_argmax_matches_and_checks_its_inputs() {
    let (acc, one_batch, empty, errors) = run_ranks_ok(2, ThreadGroupConfig::default(), |pg| {
        // No parameters: the logits are the input rows themselves.
        let m = FsdpModel::builder(pg, FsdpConfig::default())
            .unit("id", |_vb| Ok(candle_nn::func(|x| Ok(x.clone()))))
            .build()?;
        let full = m.gather_full_model(false)?.expect("every rank asked");
        let x = Tensor::new(
            &[
                [0.9f32, 0.1, 0.0],
                [0.0, 0.2, 0.8],
                [0.1, 0.7, 0.2],
                [0.6, 0.3, 0.1],
                [0.0, 0.0, 1.0],
            ],
            &Device::Cpu,
        )?;
        // argmax rows: 0, 2, 1, 0, 2; labels agree on 4 of 5.
        let y = Tensor::new(&[0u32, 2, 1, 1, 2], &Device::Cpu)?;
        // Batches of 2 (the last one partial) and one batch larger than N.
        let acc = accuracy(&full, &x, &y, 2)?;
        let one_batch = accuracy(&full, &x, &y, 64)?;
        let empty = accuracy(&full, &x.narrow(0, 0, 0)?, &y.narrow(0, 0, 0)?, 2)?;
        let errors = [
            accuracy(&full, &x, &y, 0).unwrap_err().to_string(),
            accuracy(&full, &x, &y.narrow(0, 0, 4)?, 2)
                .unwrap_err()
                .to_string(),
        ];
        Ok((acc, one_batch, empty, errors))
    })
    .unwrap()
    .remove(0);
    assert!((acc - 80.0).abs() < 1e-9, "{acc}");
    assert!((one_batch - 80.0).abs() < 1e-9, "{one_batch}");
    assert_eq!(empty, 0.0);
    assert!(
        errors[0].contains("accuracy: batch must be at least 1, found 0"),
        "{}",
        errors[0]
    );
    assert!(
        errors[1].contains("the labels of 5 images: expected [5] (one per image), found [4]"),
        "{}",
        errors[1]
    );
}
