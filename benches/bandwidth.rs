//! Bandwidth sweep of the collectives FSDP uses, nccl-tests style: all-gather, reduce-scatter
//! and all-reduce (f32, sum) from 4 KiB to 256 MiB, at world sizes 2 and 4, on every backend of the build, next
//! to a single-thread memcpy of the same size, in one run:
//! - `threads`: the in-process backend (ranks as threads);
//! - `shm`: the shared-memory backend, one process per rank as under `fsdp-run` (this binary
//!   started `ws` times with `--shm-worker` and torchrun-style variables);
//! - `tcp`: the TCP backend, one process per rank as under `fsdp-run --nnodes N` (the same
//!   workers with `LOCAL_WORLD_SIZE=1` in each, over the loopback interface);
//! - `mpi` (feature `mpi`, `mpirun` on PATH): this backend's collectives, one process per rank;
//! - `mpi-native`: OpenMPI's own `MPI_Allgather` / `MPI_Reduce_scatter_block` / `MPI_Allreduce`
//!   on the same processes, for reference.
//!
//! `cargo bench --bench bandwidth [--features mpi]`. The MPI rows come from this same binary
//! started by `mpirun -n <ws> <this binary> --mpi-worker`. `BW_MAX_MIB` caps the largest size.
//!
//! On a GPU (feature `cuda`, `BW_DEVICE=cuda[:N]`): the rows are the thread backend on CUDA
//! tensors (`threads-cuda`: 2 and 4 ranks sharing GPU N, device-to-device copies on the comm
//! streams), each operation waited for on the host; the memcpy column stays the host's.
//!
//! Definitions (nccl-tests, `doc/PERFORMANCE.md`): `size` is the whole buffer (the all-gather's
//! output, the reduce-scatter's input, as in nccl-tests); `time` is the mean per operation of the
//! slowest rank, each operation waited for before the next is issued; algorithm bandwidth
//! `algbw = size / time`; bus bandwidth `busbw = algbw · (n - 1) / n` for all-gather and
//! reduce-scatter, `busbw = algbw · 2(n - 1) / n` for all-reduce (its buffer is `size` on every
//! rank, input and output).

use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Tensor};
use candle_fsdp::alloc::in_shared;
use candle_fsdp::comm::{ProcessGroup, ProcessGroupExt, ReduceOp};
use candle_fsdp::launch::{launch, Launcher};

// The shm workers' inputs come from their shared arenas (`in_shared`), read in place by the
// peers, as under the examples' allocator (`candle_fsdp::alloc::SharedLarge`); the other
// backends do not use it.
#[global_allocator]
static GLOBAL: candle_fsdp::alloc::SharedLarge =
    candle_fsdp::alloc::SharedLarge(std::alloc::System);

const OPS: [&str; 3] = ["all_gather", "reduce_scatter", "all_reduce"];

/// Elements of (input, output) of `op` for a `size`-byte buffer at world size `ws`.
fn lengths(op: &str, size: usize, ws: usize) -> (usize, usize) {
    let whole = size / 4 / ws * ws;
    let part = whole / ws;
    match op {
        "all_gather" => (part, whole),
        "reduce_scatter" => (whole, part),
        _ => (whole, whole),
    }
}

fn sizes() -> Vec<usize> {
    let max_mib: usize = std::env::var("BW_MAX_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    (0..9)
        .map(|k| 4096usize << (2 * k))
        .filter(|&s| s <= max_mib << 20)
        .collect()
}

/// Operations timed for `size` bytes (about 1 GiB moved, 3 to 200 operations).
fn iters(size: usize) -> usize {
    ((1usize << 30) / size).clamp(3, 200)
}

/// One measured point: (op, size in bytes, seconds per operation of the slowest rank).
type Row = (String, usize, f64);

/// Times every op and size on `pg`; every rank returns the same rows.
fn sweep(pg: &Arc<dyn ProcessGroup>) -> candle_fsdp::Result<Vec<Row>> {
    let ws = pg.world_size();
    let stream = pg.new_stream("bench")?;
    let mut rows = Vec::new();
    for op in OPS {
        for size in sizes() {
            let (n_in, n_out) = lengths(op, size, ws);
            // What a collective reads (the input; the all-reduce's buffer) is made as the FSDP
            // runtime makes its comm buffers: in the shared arena under shm (read in place).
            let input = in_shared(|| Tensor::ones(n_in, DType::F32, pg.device()))?;
            let mut out = Some(in_shared(|| Tensor::zeros(n_out, DType::F32, pg.device()))?);
            let mut run = |n: usize| -> candle_fsdp::Result<f64> {
                pg.barrier_wait()?;
                let start = Instant::now();
                for _ in 0..n {
                    let o = out.take().expect("output");
                    let w = match op {
                        "all_gather" => pg.all_gather(&stream, &input, o),
                        "reduce_scatter" => pg.reduce_scatter(&stream, &input, o, ReduceOp::Sum),
                        // In place on a buffer of zeros (which stay zeros however often
                        // they are summed): no copy inside the timing.
                        _ => pg.all_reduce(&stream, o, ReduceOp::Sum),
                    };
                    out = Some(w.wait()?);
                }
                Ok(start.elapsed().as_secs_f64() / n as f64)
            };
            run(2)?;
            let t = run(iters(size))?;
            let slowest = pg.all_reduce_f32s(vec![t as f32], ReduceOp::Max)?[0] as f64;
            let o = out.expect("output").to_vec1::<f32>()?;
            let expect = match op {
                "all_gather" => 1.0,
                "reduce_scatter" => ws as f32,
                _ => 0.0,
            };
            assert!(o.iter().all(|&x| x == expect), "{op} {size}: wrong result");
            rows.push((op.to_string(), size, slowest));
        }
    }
    Ok(rows)
}

/// OpenMPI's own collectives on `MPI_COMM_WORLD`, timed the same way.
#[cfg(feature = "mpi")]
fn native_sweep(rank: usize, ws: usize) -> Vec<Row> {
    use mpi::ffi;
    let mut rows = Vec::new();
    // SAFETY: plain MPI calls on live buffers; MPI was initialised by the launcher.
    unsafe {
        let world = ffi::RSMPI_COMM_WORLD;
        let slowest = |t: f64| {
            let mut m = 0f64;
            ffi::MPI_Allreduce(
                &t as *const f64 as *const _,
                &mut m as *mut f64 as *mut _,
                1,
                ffi::RSMPI_DOUBLE,
                ffi::RSMPI_MAX,
                world,
            );
            m
        };
        for op in OPS {
            for size in sizes() {
                let (n_in, n_out) = lengths(op, size, ws);
                let part = size / 4 / ws;
                let input = vec![1.0f32; n_in];
                let mut out = vec![0.0f32; n_out];
                let mut run = |n: usize| {
                    ffi::MPI_Barrier(world);
                    let start = Instant::now();
                    for _ in 0..n {
                        if op == "all_gather" {
                            ffi::MPI_Allgather(
                                input.as_ptr() as *const _,
                                part as i32,
                                ffi::RSMPI_FLOAT,
                                out.as_mut_ptr() as *mut _,
                                part as i32,
                                ffi::RSMPI_FLOAT,
                                world,
                            );
                        } else if op == "all_reduce" {
                            ffi::MPI_Allreduce(
                                input.as_ptr() as *const _,
                                out.as_mut_ptr() as *mut _,
                                n_in as i32,
                                ffi::RSMPI_FLOAT,
                                ffi::RSMPI_SUM,
                                world,
                            );
                        } else {
                            ffi::MPI_Reduce_scatter_block(
                                input.as_ptr() as *const _,
                                out.as_mut_ptr() as *mut _,
                                part as i32,
                                ffi::RSMPI_FLOAT,
                                ffi::RSMPI_SUM,
                                world,
                            );
                        }
                    }
                    start.elapsed().as_secs_f64() / n as f64
                };
                run(2);
                let t = slowest(run(iters(size)));
                rows.push((op.to_string(), size, t));
            }
        }
    }
    let _ = rank;
    rows
}

/// Under `mpirun`: rank 0 prints `ROW backend op size seconds` lines.
#[cfg(feature = "mpi")]
fn mpi_worker() {
    let launcher = Launcher::mpi(Default::default()).expect("MPI starts");
    let rows = launch(&launcher, |pg| sweep(&pg)).expect("MPI sweep");
    let (rank, ws) = (launcher.local_ranks().start, launcher.world_size());
    let native = native_sweep(rank, ws);
    if rank == 0 {
        for (backend, rows) in [("mpi", &rows[0]), ("mpi-native", &native)] {
            for (op, size, t) in rows {
                println!("ROW {backend} {op} {size} {t}");
            }
        }
    }
}

/// A rank of the job `worker_rows` starts (the shared-memory or TCP backend, as the launcher
/// picks from the variables): rank 0 prints `ROW <backend> op size seconds` lines.
fn shm_worker() {
    let launcher = Launcher::from_env(None, 1, std::time::Duration::from_secs(300))
        .expect("a torchrun-style CPU launch");
    let backend = launcher.backend();
    let rows = launch(&launcher, |pg| sweep(&pg)).expect("worker sweep");
    if launcher.local_ranks().start == 0 {
        for (op, size, t) in &rows[0] {
            println!("ROW {backend} {op} {size} {t}");
        }
    }
}

/// The rows of the shared-memory (`tcp` false) or TCP (`tcp` true: every process alone on its
/// "machine", `LOCAL_WORLD_SIZE=1`) backend at `ws` processes (this binary started `ws` times,
/// the store on a free port), or why there are none.
fn worker_rows(ws: usize, tcp: bool) -> Result<Vec<(String, Row)>, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port();
    let children = (0..ws)
        .map(|rank| {
            Command::new(&exe)
                .arg("--shm-worker")
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", ws.to_string())
                .env("LOCAL_RANK", if tcp { 0 } else { rank }.to_string())
                .env("LOCAL_WORLD_SIZE", if tcp { 1 } else { ws }.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .stdout(std::process::Stdio::piped())
                .spawn()
                .map_err(|e| format!("starting rank {rank}: {e}"))
        })
        .collect::<Result<Vec<_>, String>>()?;
    let mut rows = Vec::new();
    for (rank, child) in children.into_iter().enumerate() {
        let out = child.wait_with_output().map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(format!("rank {rank} {}", out.status));
        }
        rows.extend(parse_rows(&String::from_utf8_lossy(&out.stdout)));
    }
    Ok(rows)
}

/// The `ROW backend op size seconds` lines of a worker's output.
fn parse_rows(stdout: &str) -> Vec<(String, Row)> {
    stdout
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            match f.as_slice() {
                ["ROW", backend, op, size, t] => Some((
                    backend.to_string(),
                    (op.to_string(), size.parse().ok()?, t.parse().ok()?),
                )),
                _ => None,
            }
        })
        .collect()
}

/// The MPI backends' rows at `ws` processes, or why there are none.
fn mpi_rows(ws: usize) -> Result<Vec<(String, Row)>, String> {
    if !cfg!(feature = "mpi") {
        return Err("built without the `mpi` feature".into());
    }
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let out = Command::new("mpirun")
        .args([
            "--allow-run-as-root",
            "--oversubscribe",
            "-n",
            &ws.to_string(),
        ])
        .arg(exe)
        .arg("--mpi-worker")
        .output()
        .map_err(|e| format!("mpirun: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "mpirun failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(parse_rows(&String::from_utf8_lossy(&out.stdout)))
}

/// Seconds per single-thread copy of `size` bytes (mean of several).
fn memcpy_time(size: usize) -> f64 {
    let src = vec![1u8; size];
    let mut dst = vec![0u8; size];
    dst.copy_from_slice(&src);
    let n = ((1usize << 31) / size).clamp(3, 100_000);
    let start = Instant::now();
    for _ in 0..n {
        dst.copy_from_slice(std::hint::black_box(&src));
    }
    std::hint::black_box(&dst);
    start.elapsed().as_secs_f64() / n as f64
}

fn human(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    }
}

/// The GPU of `BW_DEVICE=cuda[:N]` (`None`: the CPU). Exits with a message when the value is
/// bad or the build has no GPU path.
fn gpu_from_env() -> Option<usize> {
    let v = std::env::var("BW_DEVICE").ok()?;
    let spec: candle_fsdp::device::DeviceSpec = v.parse().unwrap_or_else(|e| {
        eprintln!("BW_DEVICE: {e}");
        std::process::exit(2)
    });
    let n = spec.ordinal().unwrap_or_else(|e| {
        eprintln!("BW_DEVICE: {e}");
        std::process::exit(2)
    })?;
    if !cfg!(feature = "cuda") {
        eprintln!("BW_DEVICE={v}: this build has no GPU path; rebuild with --features cuda");
        std::process::exit(2)
    }
    Some(n)
}

fn main() {
    if std::env::args().any(|a| a == "--shm-worker") {
        shm_worker();
        return;
    }
    if std::env::args().any(|a| a == "--mpi-worker") {
        #[cfg(feature = "mpi")]
        mpi_worker();
        return;
    }
    // `cargo test --benches` runs bench binaries with `--test`: nothing to check quickly here.
    if std::env::args().any(|a| a == "--test") {
        return;
    }
    let mut rows: Vec<(usize, String, Row)> = Vec::new();
    let gpu = gpu_from_env();
    for ws in [2usize, 4] {
        let (launcher, label) = match gpu {
            #[cfg(feature = "cuda")]
            Some(n) => (Launcher::threads_on_gpu(ws, n), "threads-cuda"),
            _ => (Launcher::threads(ws), "threads"),
        };
        let threads = launch(&launcher, |pg| sweep(&pg)).unwrap_or_else(|e| {
            eprintln!("bandwidth: the {label} sweep at world size {ws} failed: {e}");
            std::process::exit(1)
        });
        for r in threads.into_iter().next().expect("rank 0") {
            rows.push((ws, label.into(), r));
        }
        if gpu.is_some() {
            continue;
        }
        for (tcp, name) in [(false, "shm"), (true, "tcp")] {
            match worker_rows(ws, tcp) {
                Ok(got) => rows.extend(got.into_iter().map(|(b, r)| (ws, b, r))),
                Err(why) => eprintln!("no {name} rows at ws {ws}: {why}"),
            }
        }
        match mpi_rows(ws) {
            Ok(mpi) => rows.extend(mpi.into_iter().map(|(b, r)| (ws, b, r))),
            Err(why) => eprintln!("no MPI rows at ws {ws}: {why}"),
        }
    }
    println!(
        "| op | ws | size | backend | time (us) | algbw (GB/s) | busbw (GB/s) | memcpy (GB/s) |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let mut memcpy = std::collections::HashMap::new();
    for op in OPS {
        for ws in [2usize, 4] {
            for size in sizes() {
                let mc = *memcpy
                    .entry(size)
                    .or_insert_with(|| size as f64 / memcpy_time(size) / 1e9);
                for (w, backend, (o, s, t)) in &rows {
                    if *w != ws || o != op || *s != size {
                        continue;
                    }
                    let algbw = size as f64 / t / 1e9;
                    let factor = if op == "all_reduce" { 2.0 } else { 1.0 };
                    let busbw = algbw * factor * (ws - 1) as f64 / ws as f64;
                    println!(
                        "| {op} | {ws} | {} | {backend} | {:.1} | {algbw:.2} | {busbw:.2} | {mc:.2} |",
                        human(size),
                        t * 1e6
                    );
                }
            }
        }
    }
}
