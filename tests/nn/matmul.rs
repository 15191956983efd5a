//! `nn::kernels::matmul` through its public strided views: a transposed view against a direct
//! f64 product, and bounds checks that refuse, with their message, views and row strides whose
//! last offset overflows `usize` (a wrapped sum once passed the check and the kernel read or
//! wrote 2⁶³ elements away: a segfault from safe code); the same for attention's shape.

use candle_fsdp::nn::kernels::{matmul, matmul_new, Mat};

/// `(i·7 + j·3) mod 11`, scaled into [-0.5, 0.5].
fn value(i: usize) -> f32 {
    ((i * 7 + 3) % 11) as f32 / 10.0 - 0.5
}

#[test]
fn a_transposed_view_multiplies_as_the_direct_product() {
    let (m, k, n) = (33, 70, 45);
    let a: Vec<f32> = (0..m * k).map(value).collect();
    // `b` stored as `n × k` and read transposed.
    let bt: Vec<f32> = (0..n * k).map(|i| value(i + 5)).collect();
    let got = matmul_new(Mat::new(&a, m, k), Mat::new(&bt, n, k).t());
    for i in 0..m {
        for j in 0..n {
            let want: f64 = (0..k)
                .map(|p| a[i * k + p] as f64 * bt[j * k + p] as f64)
                .sum();
            assert!(
                (got[i * n + j] as f64 - want).abs() < 1e-5,
                "({i}, {j}): {} against {want}",
                got[i * n + j]
            );
        }
    }
}

/// The message of `f`'s panic.
fn panic_message(f: impl FnOnce() + std::panic::UnwindSafe) -> String {
    let e = std::panic::catch_unwind(f).expect_err("should have panicked");
    e.downcast_ref::<String>()
        .cloned()
        .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

#[test]
fn strides_whose_last_offset_overflows_are_refused() {
    // 3 · rs + 1 wraps to 3 < 8: the view's row 1 is 2⁶² elements away.
    let rs = usize::MAX / 3 + 1;
    let a = [0.5f32; 8];
    let b = [0.25f32; 4];
    let wrapped = Mat {
        data: &a,
        rows: 4,
        cols: 2,
        rs,
        cs: 1,
    };
    let msg = panic_message(|| {
        matmul_new(wrapped, Mat::new(&b, 2, 2));
    });
    assert!(msg.contains("a view runs past its data"), "{msg}");
    let msg = panic_message(|| {
        let mut dst = [0f32; 8];
        matmul(&mut dst, rs, false, Mat::new(&a, 4, 2), Mat::new(&b, 2, 2));
    });
    assert!(msg.contains("cannot hold 4×2"), "{msg}");
}

#[test]
fn an_attention_shape_whose_size_overflows_is_refused() {
    use candle_fsdp::nn::kernels::{attention_forward, AttentionOptions, AttentionShape};
    // batch · seq · qkv_width = 6 · (2⁶³ + 1) = 3 · 2⁶⁴ + 6 wraps to the 6 elements given.
    let shape = AttentionShape {
        batch: (1usize << 63) + 1,
        seq: 1,
        n_head: 1,
        n_kv_head: 1,
        head_dim: 2,
    };
    let qkv = [0.1f32; 6];
    let msg = panic_message(|| {
        attention_forward(&qkv, None, shape, &AttentionOptions::new(1, 1), None);
    });
    assert!(msg.contains("does not fit a qkv of 6 elements"), "{msg}");
}

#[test]
fn an_attention_shape_without_query_heads_is_refused() {
    use candle_fsdp::nn::kernels::{
        attention_backward, attention_forward, AttentionOptions, AttentionShape,
    };
    // 0 query heads "divide" by any key/value head count: the backward would run no task and
    // hand back its key/value columns unwritten.
    let shape = AttentionShape {
        batch: 1,
        seq: 3,
        n_head: 0,
        n_kv_head: 1,
        head_dim: 2,
    };
    let qkv = [0.1f32; 12];
    let opts = AttentionOptions::new(1, 1);
    let msg = panic_message(|| {
        attention_backward(&qkv, None, &[], &[], shape, &opts, None);
    });
    assert!(msg.contains("does not fit a qkv of 12 elements"), "{msg}");
    let msg = panic_message(|| {
        attention_forward(&qkv, None, shape, &opts, None);
    });
    assert!(msg.contains("does not fit a qkv of 12 elements"), "{msg}");
}
