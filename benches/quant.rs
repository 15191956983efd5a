//! Throughput of the packed frozen base's formats (`candle_fsdp::quant`): `unpack` (what each
//! gather of a packed unit pays on the compute thread) and `pack` (once, at build), on 2^24
//! elements (64 MiB of f32), against a plain f32 copy of the same output size (the memory
//! bound of writing the unsharded buffer).
//!
//! `cargo bench --bench quant`. Each line: minimum and median of 20 runs after 3 warm-up runs,
//! in ms and in G elements/s, into a reused output buffer ("warm") and into a fresh one
//! ("fresh": what a new unsharded buffer per gather costs, page faults included).

use std::time::Instant;

use candle_fsdp::quant::{pack, unpack, BaseDType};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const N: usize = 1 << 24;

fn time_ms(mut f: impl FnMut()) -> (f64, f64) {
    for _ in 0..3 {
        f();
    }
    let mut t: Vec<f64> = (0..20)
        .map(|_| {
            let t0 = Instant::now();
            f();
            t0.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    t.sort_by(f64::total_cmp);
    (t[0], t[t.len() / 2])
}

fn line(what: &str, (min, med): (f64, f64)) {
    println!(
        "{what:<28} min {min:8.2} ms  median {med:8.2} ms  {:6.2} G elements/s",
        N as f64 / min / 1e6
    );
}

fn main() {
    let x: Vec<f32> = (0..N)
        .map(|i| ((i as u64 * 2654435761) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let src = x.clone();
    let mut out = vec![0f32; N];
    line(
        "f32 copy (warm)",
        time_ms(|| out.copy_from_slice(std::hint::black_box(&src))),
    );
    for f in [BaseDType::Bf16, BaseDType::Int8, BaseDType::Nf4] {
        let mut bytes = vec![0u8; f.packed_bytes(N)];
        line(
            &format!("pack {}", f.name()),
            time_ms(|| pack(f, &x, &mut bytes).unwrap()),
        );
        line(
            &format!("unpack {} (warm)", f.name()),
            time_ms(|| unpack(f, &bytes, &mut out).unwrap()),
        );
        line(
            &format!("unpack {} (fresh)", f.name()),
            time_ms(|| {
                let mut o = vec![0f32; N];
                unpack(f, &bytes, &mut o).unwrap();
                std::hint::black_box(&o);
            }),
        );
    }
}
