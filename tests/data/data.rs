//! Tests of the data module: distributed sampler, MNIST IDX reader, batch loader. The MNIST
//! reader tests and the two loader tests over real MNIST need the cargo feature `mnist`.

use std::collections::HashSet;
use std::sync::Arc;

use candle_fsdp::data::{BatchLoader, DistributedSampler};
use candle_fsdp::Error;
#[cfg(feature = "mnist")]
use {
    candle_core::DType,
    candle_fsdp::data::{read_idx_images, read_idx_labels, Mnist},
    std::path::{Path, PathBuf},
    std::sync::atomic::{AtomicUsize, Ordering},
    std::sync::OnceLock,
    std::time::{Duration, Instant},
};

// ---------------------------------------------------------------------------------------------
// Sampler
// ---------------------------------------------------------------------------------------------

fn rank_lists(
    len: usize,
    ws: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    epoch: u64,
) -> Vec<Vec<usize>> {
    (0..ws)
        .map(|r| {
            let mut s = DistributedSampler::new(len, ws, r, shuffle, seed, drop_last).unwrap();
            s.set_epoch(epoch);
            let idx = s.indices();
            assert_eq!(idx.len(), s.num_samples());
            assert_eq!(idx.len(), s.len());
            idx
        })
        .collect()
}

#[test]
fn sampler_disjoint_and_covering_when_divisible() {
    for ws in 1..=4 {
        for mult in [1usize, 2, 3, 7, 25] {
            let len = ws * mult;
            for shuffle in [false, true] {
                for drop_last in [false, true] {
                    let lists = rank_lists(len, ws, shuffle, 42, drop_last, 3);
                    let mut all: Vec<usize> = lists.iter().flatten().copied().collect();
                    assert_eq!(all.len(), len, "ws {ws} len {len}");
                    all.sort_unstable();
                    assert_eq!(all, (0..len).collect::<Vec<_>>(), "ws {ws} len {len}");
                    for l in &lists {
                        assert_eq!(l.len(), mult);
                    }
                    let s = DistributedSampler::new(len, ws, 0, shuffle, 42, drop_last).unwrap();
                    assert_eq!(s.total_size(), len);
                    assert_eq!(s.num_samples(), mult);
                }
            }
        }
    }
}

#[test]
fn sampler_shuffle_is_a_permutation_not_identity() {
    let s = DistributedSampler::new(100, 1, 0, true, 7, false).unwrap();
    let g = s.global_indices();
    let mut sorted = g.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..100).collect::<Vec<_>>());
    assert_ne!(g, (0..100).collect::<Vec<_>>());
}

#[test]
fn sampler_padding_wraps_to_start() {
    // len 10, ws 4: num_samples 3, total 12; the two extra entries are the permuted list's
    // first two.
    let s0 = DistributedSampler::new(10, 4, 0, true, 5, false).unwrap();
    assert_eq!(s0.num_samples(), 3);
    assert_eq!(s0.total_size(), 12);
    let g = s0.global_indices();
    assert_eq!(g.len(), 12);
    let base = &g[..10];
    let mut sorted = base.to_vec();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..10).collect::<Vec<_>>());
    assert_eq!(g[10], g[0]);
    assert_eq!(g[11], g[1]);
    let lists = rank_lists(10, 4, true, 5, false, 0);
    for (r, l) in lists.iter().enumerate() {
        let expected: Vec<usize> = (0..3).map(|k| g[r + 4 * k]).collect();
        assert_eq!(l, &expected, "rank {r}");
    }
    // Ranks 2 and 3 take positions 10 and 11: the padded repeats of g[0] and g[1].
    assert_eq!(lists[2][2], g[0]);
    assert_eq!(lists[3][2], g[1]);
    let all: HashSet<usize> = lists.iter().flatten().copied().collect();
    assert_eq!(all.len(), 10);

    // Unshuffled: exactly [0..10, 0, 1].
    let s = DistributedSampler::new(10, 4, 0, false, 0, false).unwrap();
    assert_eq!(s.global_indices(), vec![0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]);
}

#[test]
fn sampler_padding_repeats_when_padding_exceeds_len() {
    // len 2, ws 5: num_samples 1, total 5, padding 3 > len: list repeated → [a, b, a, b, a].
    let s = DistributedSampler::new(2, 5, 0, true, 11, false).unwrap();
    assert_eq!(s.num_samples(), 1);
    assert_eq!(s.total_size(), 5);
    let g = s.global_indices();
    assert_eq!(g, vec![g[0], g[1], g[0], g[1], g[0]]);
    let lists = rank_lists(2, 5, true, 11, false, 0);
    let flat: Vec<usize> = lists
        .iter()
        .map(|l| {
            assert_eq!(l.len(), 1);
            l[0]
        })
        .collect();
    assert_eq!(flat, g);
    let s = DistributedSampler::new(2, 5, 4, false, 0, false).unwrap();
    assert_eq!(s.indices(), vec![0]);
    let s = DistributedSampler::new(3, 8, 0, false, 0, false).unwrap();
    assert_eq!(s.global_indices(), vec![0, 1, 2, 0, 1, 2, 0, 1]);
}

#[test]
fn sampler_drop_last_truncates() {
    // len 10, ws 4, drop_last: num_samples = ceil((10-4)/4) = 2, total 8.
    let s = DistributedSampler::new(10, 4, 0, true, 9, true).unwrap();
    assert_eq!(s.num_samples(), 2);
    assert_eq!(s.total_size(), 8);
    let lists = rank_lists(10, 4, true, 9, true, 0);
    let mut all: Vec<usize> = lists.iter().flatten().copied().collect();
    assert_eq!(all.len(), 8);
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), 8, "no duplicates with drop_last");
    // The dropped items are the tail of the (unpadded) permutation.
    let full = DistributedSampler::new(10, 1, 0, true, 9, false)
        .unwrap()
        .global_indices();
    assert_eq!(s.global_indices(), full[..8].to_vec());
    // Unshuffled: rank r gets r, r+4.
    let s = DistributedSampler::new(10, 4, 3, false, 0, true).unwrap();
    assert_eq!(s.indices(), vec![3, 7]);
    // len < ws with drop_last: nothing.
    let s = DistributedSampler::new(3, 4, 0, true, 0, true).unwrap();
    assert_eq!(s.num_samples(), 0);
    assert!(s.is_empty());
    assert!(s.indices().is_empty());
    // Other PyTorch values: len 11 ws 3 → ceil(8/3) = 3.
    let s = DistributedSampler::new(11, 3, 0, false, 0, true).unwrap();
    assert_eq!((s.num_samples(), s.total_size()), (3, 9));
}

#[test]
fn sampler_epochs() {
    let a = rank_lists(50, 3, true, 1234, false, 0);
    let b = rank_lists(50, 3, true, 1234, false, 0);
    assert_eq!(a, b, "same seed and epoch must give the same order");
    let c = rank_lists(50, 3, true, 1234, false, 1);
    assert_ne!(a, c, "a new epoch must change the order");
    // Every rank derives its list from the same global permutation.
    let mut s1 = DistributedSampler::new(50, 3, 1, true, 1234, false).unwrap();
    s1.set_epoch(1);
    let mut s2 = DistributedSampler::new(50, 3, 2, true, 1234, false).unwrap();
    s2.set_epoch(1);
    assert_eq!(s1.global_indices(), s2.global_indices());
    assert_eq!(s1.epoch(), 1);
    // seed + epoch: (seed 10, epoch 1) equals (seed 11, epoch 0), as in PyTorch.
    let mut x = DistributedSampler::new(50, 1, 0, true, 10, false).unwrap();
    x.set_epoch(1);
    let y = DistributedSampler::new(50, 1, 0, true, 11, false).unwrap();
    assert_eq!(x.indices(), y.indices());
    // Without shuffle the epoch does not matter.
    assert_eq!(
        rank_lists(50, 3, false, 1, false, 0),
        rank_lists(50, 3, false, 1, false, 5)
    );
}

#[test]
fn sampler_no_shuffle_is_strided() {
    for ws in 1..=4 {
        for r in 0..ws {
            let s = DistributedSampler::new(20, ws, r, false, 99, false).unwrap();
            let n = 20usize.div_ceil(ws);
            let expected: Vec<usize> = (0..n).map(|k| (r + k * ws) % 20).collect();
            assert_eq!(s.indices(), expected, "ws {ws} rank {r}");
        }
    }
}

#[test]
fn sampler_set_start() {
    let mut s = DistributedSampler::new(30, 2, 1, true, 3, false).unwrap();
    s.set_epoch(4);
    let full = s.indices();
    assert_eq!(full.len(), 15);
    s.set_start(6);
    assert_eq!(s.start(), 6);
    assert_eq!(s.indices(), full[6..].to_vec());
    assert_eq!(s.len(), 15, "len stays num_samples");
    s.set_start(15);
    assert!(s.indices().is_empty());
    s.set_start(100);
    assert_eq!(s.start(), 15);
    assert!(s.indices().is_empty());
    s.set_start(0);
    assert_eq!(s.indices(), full);
    s.set_start(5);
    s.set_epoch(5);
    assert_eq!(s.start(), 0, "set_epoch resets the start");
    assert_eq!(s.indices().len(), 15);
}

#[test]
fn sampler_rejects_bad_rank() {
    for (ws, r) in [(0, 0), (2, 2), (4, 7)] {
        match DistributedSampler::new(10, ws, r, false, 0, false) {
            Err(e @ Error::OutOfRange { value, bound, .. }) => {
                assert_eq!((value, bound), (r, ws));
                let m = e.to_string();
                assert!(m.contains(&format!("rank {r}")), "{m}");
                assert!(m.contains(&format!("world_size {ws}")), "{m}");
            }
            other => panic!("expected Error::OutOfRange, got {other:?}"),
        }
    }
    let s = DistributedSampler::new(0, 3, 0, true, 0, false).unwrap();
    assert!(s.indices().is_empty());
}

// ---------------------------------------------------------------------------------------------
// MNIST
// ---------------------------------------------------------------------------------------------

#[cfg(feature = "mnist")]
fn mnist_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("data/mnist")
}

#[cfg(feature = "mnist")]
fn mnist() -> &'static Mnist {
    static M: OnceLock<Mnist> = OnceLock::new();
    M.get_or_init(|| Mnist::load(mnist_dir()).expect("load MNIST"))
}

#[cfg(feature = "mnist")]
fn temp_dir(tag: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let d = std::env::temp_dir().join(format!(
        "candle-fsdp-data-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[cfg(feature = "mnist")]
fn gunzip(path: &Path) -> Vec<u8> {
    use std::io::Read;
    let raw = std::fs::read(path).unwrap();
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(raw.as_slice())
        .read_to_end(&mut out)
        .unwrap();
    out
}

#[cfg(feature = "mnist")]
#[test]
fn mnist_loads_real_files() {
    let m = mnist();
    assert_eq!(m.train_len(), 60_000);
    assert_eq!(m.test_len(), 10_000);
    assert_eq!((m.rows, m.cols), (28, 28));
    assert_eq!(m.image_len(), 784);
    assert_eq!(m.train_images.len(), 60_000 * 784);
    assert_eq!(m.test_images.len(), 10_000 * 784);
    assert_eq!(m.train_labels[0], 5);
    assert_eq!(m.test_labels[0], 7);
    for imgs in [&m.train_images, &m.test_images] {
        let (mn, mx) = imgs
            .iter()
            .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &v| {
                (a.min(v), b.max(v))
            });
        assert_eq!(mn, 0.0);
        assert_eq!(mx, 1.0);
    }
    // Label histograms: 10 classes, each populated, totals match the split sizes. The
    // well-known MNIST training counts: 5923 zeros ... 5949 nines.
    let mut train_hist = [0usize; 10];
    m.train_labels
        .iter()
        .for_each(|&l| train_hist[l as usize] += 1);
    let mut test_hist = [0usize; 10];
    m.test_labels
        .iter()
        .for_each(|&l| test_hist[l as usize] += 1);
    assert_eq!(train_hist.iter().sum::<usize>(), 60_000);
    assert_eq!(test_hist.iter().sum::<usize>(), 10_000);
    assert_eq!(
        train_hist,
        [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    );
    assert_eq!(
        test_hist,
        [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    );
    // Pixel values are byte / 255 exactly.
    let (raw, count, rows, cols) =
        read_idx_images(mnist_dir().join("t10k-images-idx3-ubyte.gz")).unwrap();
    assert_eq!((count, rows, cols), (10_000, 28, 28));
    for (k, (&b, &f)) in raw.iter().zip(&m.test_images).enumerate().step_by(97) {
        assert_eq!(f, b as f32 / 255.0, "pixel {k}");
    }
}

#[cfg(feature = "mnist")]
#[test]
fn mnist_uncompressed_fallback() {
    let dir = temp_dir("plain");
    for name in [
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    ] {
        let bytes = gunzip(&mnist_dir().join(format!("{name}.gz")));
        std::fs::write(dir.join(name), bytes).unwrap();
    }
    let m = Mnist::load(&dir).unwrap();
    assert_eq!((m.train_len(), m.test_len()), (60_000, 10_000));
    assert_eq!(m.test_labels, mnist().test_labels);
    assert_eq!(m.train_images[..784 * 3], mnist().train_images[..784 * 3]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An empty training split (valid IDX headers, zero items) is an error naming the file, not a
/// run that trains on nothing and reports a NaN loss.
#[cfg(feature = "mnist")]
#[test]
fn mnist_empty_split_is_an_error_naming_it() {
    let dir = temp_dir("empty");
    let mut images = 0x0803u32.to_be_bytes().to_vec();
    for v in [0u32, 28, 28] {
        images.extend(v.to_be_bytes());
    }
    let mut labels = 0x0801u32.to_be_bytes().to_vec();
    labels.extend(0u32.to_be_bytes());
    std::fs::write(dir.join("train-images-idx3-ubyte"), &images).unwrap();
    std::fs::write(dir.join("train-labels-idx1-ubyte"), &labels).unwrap();
    for name in ["t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"] {
        let bytes = gunzip(&mnist_dir().join(format!("{name}.gz")));
        std::fs::write(dir.join(name), bytes).unwrap();
    }
    let err = Mnist::load(&dir).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::File { .. }), "{err:?}");
    assert!(msg.contains("train-images-idx3-ubyte"), "{msg}");
    assert!(msg.contains("holds no images"), "{msg}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[cfg(feature = "mnist")]
#[test]
fn mnist_truncated_file_is_an_error_naming_it() {
    let dir = temp_dir("trunc");
    // Uncompressed labels cut short: 8-byte header says 10000, only 5000 labels present.
    let labels = gunzip(&mnist_dir().join("t10k-labels-idx1-ubyte.gz"));
    let path = dir.join("t10k-labels-idx1-ubyte");
    std::fs::write(&path, &labels[..8 + 5000]).unwrap();
    let err = read_idx_labels(&path).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::File { .. }), "{err:?}");
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    assert!(msg.contains("expected 10008 bytes"), "{msg}");
    assert!(msg.contains("found 5008"), "{msg}");

    // Uncompressed images cut short.
    let images = gunzip(&mnist_dir().join("t10k-images-idx3-ubyte.gz"));
    let ipath = dir.join("t10k-images-idx3-ubyte");
    std::fs::write(&ipath, &images[..16 + 784 * 10]).unwrap();
    let msg = read_idx_images(&ipath).unwrap_err().to_string();
    assert!(msg.contains(&ipath.display().to_string()), "{msg}");
    assert!(
        msg.contains(&format!("expected {} bytes", 16 + 784 * 10_000)),
        "{msg}"
    );
    assert!(msg.contains(&format!("found {}", 16 + 784 * 10)), "{msg}");

    // Truncated gzip: half of the compressed file.
    let gz = std::fs::read(mnist_dir().join("t10k-images-idx3-ubyte.gz")).unwrap();
    let gpath = dir.join("t10k-images-idx3-ubyte.gz");
    std::fs::write(&gpath, &gz[..gz.len() / 2]).unwrap();
    let msg = read_idx_images(&gpath).unwrap_err().to_string();
    assert!(msg.contains(&gpath.display().to_string()), "{msg}");
    assert!(msg.contains("gzip decompression failed"), "{msg}");

    // Through Mnist::load: the truncated .gz is preferred over the plain file and named.
    for name in ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"] {
        std::fs::copy(mnist_dir().join(name), dir.join(name)).unwrap();
    }
    std::fs::write(dir.join("t10k-labels-idx1-ubyte"), &labels).unwrap();
    let msg = Mnist::load(&dir).unwrap_err().to_string();
    assert!(msg.contains("t10k-images-idx3-ubyte.gz"), "{msg}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[cfg(feature = "mnist")]
#[test]
fn mnist_wrong_magic_and_mismatches() {
    let dir = temp_dir("magic");
    let mut labels = gunzip(&mnist_dir().join("t10k-labels-idx1-ubyte.gz"));
    let images = gunzip(&mnist_dir().join("t10k-images-idx3-ubyte.gz"));

    // An image file handed to the label reader: magic 2051 instead of 2049.
    let ipath = dir.join("images-as-labels");
    std::fs::write(&ipath, &images).unwrap();
    let err = read_idx_labels(&ipath).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains(&ipath.display().to_string()), "{msg}");
    assert!(msg.contains("expected 2049, found 2051"), "{msg}");

    // Corrupted magic in a label file.
    let mut bad = labels.clone();
    bad[3] = 0x02; // 0x00000802 = 2050
    let bpath = dir.join("bad-magic");
    std::fs::write(&bpath, &bad).unwrap();
    let msg = read_idx_labels(&bpath).unwrap_err().to_string();
    assert!(msg.contains("bad-magic"), "{msg}");
    assert!(msg.contains("expected 2049, found 2050"), "{msg}");
    let msg = read_idx_images(&bpath).unwrap_err().to_string();
    assert!(msg.contains("bad-magic"), "{msg}");
    assert!(msg.contains("expected 2051, found 2050"), "{msg}");

    // Trailing bytes are rejected.
    let mut long = labels.clone();
    long.push(0);
    let lpath = dir.join("long-labels");
    std::fs::write(&lpath, &long).unwrap();
    let msg = read_idx_labels(&lpath).unwrap_err().to_string();
    assert!(msg.contains("expected 10008 bytes, found 10009"), "{msg}");

    // Label out of range and count mismatch through Mnist::load.
    for name in ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"] {
        std::fs::copy(mnist_dir().join(name), dir.join(name)).unwrap();
    }
    std::fs::write(dir.join("t10k-images-idx3-ubyte"), &images).unwrap();
    labels[8 + 17] = 12;
    std::fs::write(dir.join("t10k-labels-idx1-ubyte"), &labels).unwrap();
    let msg = Mnist::load(&dir).unwrap_err().to_string();
    assert!(msg.contains("t10k-labels-idx1-ubyte"), "{msg}");
    assert!(msg.contains("label 17 is 12"), "{msg}");

    // 9999 labels for 10000 images.
    let mut short = labels[..8 + 9999].to_vec();
    short[4..8].copy_from_slice(&9999u32.to_be_bytes());
    std::fs::write(dir.join("t10k-labels-idx1-ubyte"), &short).unwrap();
    let msg = Mnist::load(&dir).unwrap_err().to_string();
    assert!(msg.contains("t10k-labels-idx1-ubyte"), "{msg}");
    assert!(msg.contains("expected 10000 labels, found 9999"), "{msg}");

    // Missing file.
    let empty = temp_dir("empty");
    let msg = Mnist::load(&empty).unwrap_err().to_string();
    assert!(msg.contains("train-images-idx3-ubyte"), "{msg}");
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(&empty).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Loader
// ---------------------------------------------------------------------------------------------

#[cfg(feature = "mnist")]
type Shared = (Arc<Vec<f32>>, Arc<Vec<u8>>);

#[cfg(feature = "mnist")]
fn mnist_train_arcs() -> Shared {
    static A: OnceLock<Shared> = OnceLock::new();
    A.get_or_init(|| {
        let m = mnist();
        (
            Arc::new(m.train_images.clone()),
            Arc::new(m.train_labels.clone()),
        )
    })
    .clone()
}

#[cfg(feature = "mnist")]
#[test]
fn loader_batches_cover_indices_in_order() {
    let (images, labels) = mnist_train_arcs();
    let mut sampler = DistributedSampler::new(labels.len(), 3, 2, true, 17, false).unwrap();
    sampler.set_epoch(2);
    let indices: Vec<usize> = sampler.indices().into_iter().take(1000).collect();
    let loader = BatchLoader::new(
        images.clone(),
        labels.clone(),
        (1, 28, 28),
        indices.clone(),
        64,
        false,
    )
    .unwrap();
    assert_eq!(loader.num_batches(), 16); // ceil(1000 / 64)
    let mut seen = Vec::new();
    let mut sizes = Vec::new();
    for batch in loader {
        let b = batch.unwrap();
        let n = b.len();
        sizes.push(n);
        assert_eq!(b.images.dims(), &[n, 1, 28, 28]);
        assert_eq!(b.images.dtype(), DType::F32);
        assert_eq!(b.labels.dims(), &[n]);
        assert_eq!(b.labels.dtype(), DType::U32);
        let labs = b.labels.to_vec1::<u32>().unwrap();
        for (k, &i) in b.indices.iter().enumerate() {
            assert_eq!(labs[k], labels[i] as u32);
        }
        // Image values of one row match the source slice exactly.
        let row = b
            .images
            .get(n - 1)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let i = b.indices[n - 1];
        assert_eq!(row, images[i * 784..(i + 1) * 784].to_vec());
        seen.extend(b.indices);
    }
    assert_eq!(seen, indices);
    assert_eq!(sizes.len(), 16);
    assert!(sizes[..15].iter().all(|&s| s == 64));
    assert_eq!(sizes[15], 1000 - 15 * 64); // 40
}

#[test]
fn loader_drop_last_and_small_cases() {
    // A tiny synthetic dataset: item i has all values i (as f32), label i % 10, shape (2, 1, 3).
    let n = 23;
    let images: Vec<f32> = (0..n)
        .flat_map(|i| std::iter::repeat_n(i as f32, 6))
        .collect();
    let labels: Vec<u8> = (0..n).map(|i| (i % 10) as u8).collect();
    let (images, labels) = (Arc::new(images), Arc::new(labels));
    let indices: Vec<usize> = (0..n).rev().collect();

    let l = BatchLoader::new(
        images.clone(),
        labels.clone(),
        (2, 1, 3),
        indices.clone(),
        5,
        true,
    )
    .unwrap();
    assert_eq!(l.num_batches(), 4);
    let batches: Vec<_> = l.map(|b| b.unwrap()).collect();
    assert_eq!(batches.len(), 4);
    let flat: Vec<usize> = batches.iter().flat_map(|b| b.indices.clone()).collect();
    assert_eq!(flat, indices[..20].to_vec());
    let b = &batches[1];
    assert_eq!(b.images.dims(), &[5, 2, 1, 3]);
    let v = b.images.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let expected: Vec<f32> = b
        .indices
        .iter()
        .flat_map(|&i| std::iter::repeat_n(i as f32, 6))
        .collect();
    assert_eq!(v, expected);

    let l = BatchLoader::with_depth(
        images.clone(),
        labels.clone(),
        (2, 1, 3),
        indices.clone(),
        5,
        false,
        1,
    )
    .unwrap();
    let sizes: Vec<usize> = l.map(|b| b.unwrap().len()).collect();
    assert_eq!(sizes, vec![5, 5, 5, 5, 3]);

    // Batch larger than the list: one partial batch, or none with drop_last.
    let l = BatchLoader::new(
        images.clone(),
        labels.clone(),
        (2, 1, 3),
        vec![4, 4, 9],
        8,
        false,
    )
    .unwrap();
    let b: Vec<_> = l.map(|b| b.unwrap()).collect();
    assert_eq!(b.len(), 1);
    assert_eq!(b[0].indices, vec![4, 4, 9]);
    assert_eq!(b[0].labels.to_vec1::<u32>().unwrap(), vec![4, 4, 9]);
    let mut l = BatchLoader::new(
        images.clone(),
        labels.clone(),
        (2, 1, 3),
        vec![4, 4, 9],
        8,
        true,
    )
    .unwrap();
    assert_eq!(l.num_batches(), 0);
    assert!(l.next().is_none());
    assert!(l.next().is_none());
    let mut l =
        BatchLoader::new(images.clone(), labels.clone(), (2, 1, 3), vec![], 8, false).unwrap();
    assert!(l.next().is_none());
}

#[test]
fn loader_validates_arguments() {
    let images = Arc::new(vec![0.0f32; 10 * 4]);
    let labels = Arc::new(vec![0u8; 10]);
    let msg = match BatchLoader::new(
        images.clone(),
        labels.clone(),
        (1, 2, 2),
        vec![0, 9, 10],
        2,
        false,
    ) {
        Err(e @ Error::OutOfRange { .. }) => e.to_string(),
        other => panic!("expected Error::OutOfRange, got {other:?}"),
    };
    assert!(msg.contains("index 10"), "{msg}");
    assert!(msg.contains("len 10"), "{msg}");
    match BatchLoader::new(images.clone(), labels.clone(), (1, 2, 2), vec![0], 0, false) {
        Err(e @ Error::Value { .. }) => assert!(e.to_string().contains("batch_size"), "{e}"),
        other => panic!("expected Error::Value, got {other:?}"),
    }
    match BatchLoader::new(images.clone(), labels.clone(), (1, 3, 2), vec![0], 1, false) {
        Err(e @ Error::Shape { .. }) => {
            assert!(
                e.to_string().contains("expected 60 image values, found 40"),
                "{e}"
            )
        }
        other => panic!("expected Error::Shape, got {other:?}"),
    }
    assert!(BatchLoader::with_depth(images, labels, (1, 2, 2), vec![0], 1, false, 0).is_err());
}

#[cfg(feature = "mnist")]
#[test]
fn loader_drop_mid_iteration_returns_promptly() {
    let (images, labels) = mnist_train_arcs();
    let indices: Vec<usize> = (0..labels.len()).collect();
    for depth in [1, 2, 8] {
        let mut l = BatchLoader::with_depth(
            images.clone(),
            labels.clone(),
            (1, 28, 28),
            indices.clone(),
            256,
            false,
            depth,
        )
        .unwrap();
        assert_eq!(l.num_batches(), 235);
        let first = l.next().unwrap().unwrap();
        assert_eq!(first.indices, (0..256).collect::<Vec<_>>());
        let _second = l.next().unwrap().unwrap();
        // Let the worker fill the channel and block on send.
        std::thread::sleep(Duration::from_millis(50));
        let t = Instant::now();
        drop(l);
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "drop took {:?}",
            t.elapsed()
        );
    }
    // Dropping before consuming anything.
    let l = BatchLoader::new(images, labels, (1, 28, 28), indices, 256, false).unwrap();
    let t = Instant::now();
    drop(l);
    assert!(t.elapsed() < Duration::from_secs(1));
}
