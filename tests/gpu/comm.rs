//! Communication on a GPU: the thread backend on CUDA tensors (2 and 4 ranks sharing one GPU)
//! against the CPU thread backend, bit for bit, for every collective and dtype; stream
//! ordering (a collective issued right after a compute kernel sees its result; the host does
//! not wait for the device); buffer checks on CUDA; the NCCL group at world size 1 (local
//! unique id and the store bootstrap on 127.0.0.1); the watchdog's timeout naming the op.

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use candle_fsdp::comm::threads::ThreadGroupConfig;
use candle_fsdp::comm::{ProcessGroup, ReduceOp};
use candle_fsdp::launch::Launcher;
use candle_fsdp::Result;

const TIMEOUT: Duration = Duration::from_secs(60);

fn cpu_threads(ws: usize) -> Launcher {
    Launcher::Threads {
        world_size: ws,
        config: ThreadGroupConfig { timeout: TIMEOUT },
    }
}

fn gpu_threads(ws: usize) -> Launcher {
    Launcher::ThreadsOnGpu {
        world_size: ws,
        gpu: crate::gpu(),
        config: ThreadGroupConfig { timeout: TIMEOUT },
    }
}

/// A deterministic value of rank `r`, element `i`, `salt`: magnitudes from 1e-3 to 1e3 and
/// both signs, so that the order of a sum shows in its rounding.
fn value(r: usize, i: usize, salt: u64) -> f64 {
    let mut h = (r as u64 + 1)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add((i as u64 + 1).wrapping_mul(0xBF58_476D_1CE4_E5B9))
        .wrapping_add(salt.wrapping_mul(0x94D0_49BB_1331_11EB));
    h ^= h >> 31;
    h = h.wrapping_mul(0xD6E8_FEB8_6659_FD93);
    h ^= h >> 29;
    let mantissa = (h % 20_001) as f64 / 10_000.0 - 1.0;
    let exp = ((h >> 20) % 7) as i32 - 3;
    mantissa * 10f64.powi(exp)
}

/// The input of rank `r` on the CPU: `len` elements of `dtype` (integers small and of both
/// signs where the type has them, with sums that wrap for u8).
fn input(dtype: DType, r: usize, len: usize, salt: u64) -> Tensor {
    let vals: Vec<f64> = (0..len).map(|i| value(r, i, salt)).collect();
    let dev = &Device::Cpu;
    match dtype {
        DType::F64 => Tensor::new(vals, dev).unwrap(),
        DType::F32 | DType::BF16 | DType::F16 => {
            Tensor::new(vals.iter().map(|&v| v as f32).collect::<Vec<f32>>(), dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
        }
        DType::U8 => Tensor::new(
            vals.iter()
                .map(|&v| ((v * 1e3).abs() as u64 % 256) as u8)
                .collect::<Vec<u8>>(),
            dev,
        )
        .unwrap(),
        DType::U32 => Tensor::new(
            vals.iter()
                .map(|&v| (v * 1e6).abs() as u32)
                .collect::<Vec<u32>>(),
            dev,
        )
        .unwrap(),
        DType::I16 => Tensor::new(
            vals.iter()
                .map(|&v| ((v * 1e3) as i64 % 30_000) as i16)
                .collect::<Vec<i16>>(),
            dev,
        )
        .unwrap(),
        DType::I32 => Tensor::new(
            vals.iter().map(|&v| (v * 1e6) as i32).collect::<Vec<i32>>(),
            dev,
        )
        .unwrap(),
        DType::I64 => Tensor::new(
            vals.iter().map(|&v| (v * 1e9) as i64).collect::<Vec<i64>>(),
            dev,
        )
        .unwrap(),
        other => panic!("no test input of {other:?}"),
    }
}

/// The bits of every element (on the host), to compare results bit for bit.
fn bits(t: &Tensor) -> Vec<u64> {
    let t = t.to_device(&Device::Cpu).unwrap();
    match t.dtype() {
        DType::F64 => t
            .to_vec1::<f64>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect(),
        DType::F32 => t
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits() as u64)
            .collect(),
        DType::BF16 => t
            .to_vec1::<half::bf16>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits() as u64)
            .collect(),
        DType::F16 => t
            .to_vec1::<half::f16>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits() as u64)
            .collect(),
        DType::U8 => t
            .to_vec1::<u8>()
            .unwrap()
            .iter()
            .map(|&x| x as u64)
            .collect(),
        DType::U32 => t
            .to_vec1::<u32>()
            .unwrap()
            .iter()
            .map(|&x| x as u64)
            .collect(),
        DType::I16 => t
            .to_vec1::<i16>()
            .unwrap()
            .iter()
            .map(|&x| x as u16 as u64)
            .collect(),
        DType::I32 => t
            .to_vec1::<i32>()
            .unwrap()
            .iter()
            .map(|&x| x as u32 as u64)
            .collect(),
        DType::I64 => t
            .to_vec1::<i64>()
            .unwrap()
            .iter()
            .map(|&x| x as u64)
            .collect(),
        other => panic!("no bits of {other:?}"),
    }
}

const FLOATS: [DType; 4] = [DType::F32, DType::BF16, DType::F16, DType::F64];
const INTS: [DType; 5] = [DType::U8, DType::U32, DType::I16, DType::I32, DType::I64];

/// Every collective of the contract on `pg`, on inputs that depend only on the rank: the
/// results' bits, in a fixed order. Some calls go to a second stream, with work of both
/// streams in flight together.
fn every_collective(pg: Arc<dyn ProcessGroup>) -> Result<Vec<Vec<u64>>> {
    let (r, ws) = (pg.rank(), pg.world_size());
    let dev = pg.device().clone();
    let on = |t: Tensor| t.to_device(&dev).unwrap();
    let zeros = |dtype: DType, n: usize| Tensor::zeros(n, dtype, &dev).unwrap();
    let other = pg.new_stream("other")?;
    let default = pg.default_stream();
    let mut out = Vec::new();
    for (k, dtype) in FLOATS.iter().chain(INTS.iter()).copied().enumerate() {
        let salt = k as u64 * 100;
        let is_float = FLOATS.contains(&dtype);
        let ops: &[ReduceOp] = if is_float {
            &[ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min]
        } else {
            &[ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min]
        };
        // All-gather: lengths 1 and 333.
        for n in [1usize, 333] {
            let x = on(input(dtype, r, n, salt + n as u64));
            let w = pg.all_gather(&other, &x, zeros(dtype, ws * n));
            out.push(bits(&w.wait()?));
        }
        for (j, &op) in ops.iter().enumerate() {
            let salt = salt + 10 + j as u64;
            // Reduce-scatter on the second stream while an all-reduce runs on the default one.
            let n = 257;
            let x = on(input(dtype, r, ws * n, salt));
            let rs = pg.reduce_scatter(&other, &x, zeros(dtype, n), op);
            // All-reduce: a length that splits unevenly, and one shorter than the world.
            let ar1 = pg.all_reduce(&default, on(input(dtype, r, 1001, salt + 1)), op);
            let short = (ws - 1).max(1);
            let ar2 = pg.all_reduce(&default, on(input(dtype, r, short, salt + 2)), op);
            let red = pg.reduce(&default, on(input(dtype, r, 77, salt + 3)), ws - 1, op);
            out.push(bits(&rs.wait()?));
            out.push(bits(&ar1.wait_compute()?));
            out.push(bits(&ar2.wait()?));
            out.push(bits(&red.wait()?));
        }
        let b = pg.broadcast(&other, on(input(dtype, r, 99, salt + 50)), 1 % ws);
        out.push(bits(&b.wait()?));
    }
    pg.barrier(&default).wait()?;
    pg.barrier(&other).wait_compute()?;
    Ok(out)
}

#[test]
#[ignore = "needs a GPU; scripts/gpu-check.sh runs it"]
fn thread_backend_on_cuda_matches_the_cpu_backend_bit_for_bit() {
    for ws in [1, 2, 4] {
        let cpu = cpu_threads(ws).run(every_collective).unwrap();
        let gpu = gpu_threads(ws).run(every_collective).unwrap();
        assert_eq!(cpu.len(), ws);
        for (r, (c, g)) in cpu.iter().zip(&gpu).enumerate() {
            assert_eq!(c.len(), g.len());
            for (i, (a, b)) in c.iter().zip(g).enumerate() {
                assert_eq!(a, b, "world size {ws}, rank {r}, result {i}");
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU; scripts/gpu-check.sh runs it"]
fn nan_propagates_on_cuda_as_on_the_cpu() {
    let f = |pg: Arc<dyn ProcessGroup>| -> Result<Vec<Vec<u64>>> {
        let dev = pg.device().clone();
        let mut v = vec![1.0f32, 2.0, 3.0];
        v[pg.rank()] = f32::NAN;
        let mut out = Vec::new();
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
            let t = Tensor::new(v.clone(), &dev)?;
            out.push(bits(&pg.all_reduce(&pg.default_stream(), t, op).wait()?));
        }
        Ok(out)
    };
    let cpu = cpu_threads(2).run(f).unwrap();
    let gpu = gpu_threads(2).run(f).unwrap();
    for (c, g) in cpu.iter().zip(&gpu) {
        for (a, b) in c.iter().zip(g) {
            // NaN payloads may differ: compare NaN-ness, and the bits of everything else.
            for (x, y) in a.iter().zip(b) {
                let (x, y) = (f32::from_bits(*x as u32), f32::from_bits(*y as u32));
                assert!(x.is_nan() == y.is_nan() && (x.is_nan() || x.to_bits() == y.to_bits()));
            }
        }
    }
}

/// Many large matmuls on the compute stream (a few hundred milliseconds on a current GPU):
/// the last one's first row holds `n` in every element.
fn long_compute(dev: &Device, rounds: usize) -> Result<Tensor> {
    let n = 4096;
    let a = Tensor::ones((n, n), DType::F32, dev)?;
    let mut m = a.clone();
    for _ in 0..rounds {
        // (ones · ones) / n = ones again, after n-term sums: exact in f32.
        m = (m.matmul(&a)? / n as f64)?;
    }
    Ok((m.matmul(&a)?.get(0)?).contiguous()?)
}

#[test]
#[ignore = "needs a GPU; scripts/gpu-check.sh runs it"]
fn a_collective_issued_after_a_kernel_sees_its_result() {
    let sums = gpu_threads(2)
        .run(|pg| {
            let x = (long_compute(pg.device(), 20)? * (pg.rank() as f64 + 1.0))?;
            // No host synchronisation between the kernels and the collective.
            let y = pg
                .all_reduce(&pg.default_stream(), x, ReduceOp::Sum)
                .wait_compute()?;
            let z = (y + 1.0)?; // compute-stream work after the wait
            Ok(z.to_vec1::<f32>()?)
        })
        .unwrap();
    for s in sums {
        assert!(s.iter().all(|&v| v == 4096.0 * 3.0 + 1.0), "{:?}", &s[..4]);
    }
}

#[test]
#[ignore = "needs a GPU; scripts/gpu-check.sh runs it"]
fn the_host_does_not_wait_for_the_device_and_the_comm_stream_does() {
    let timings = gpu_threads(2)
        .run(|pg| {
            let Device::Cuda(cuda) = pg.device() else {
                panic!("a CUDA group")
            };
            let input = Tensor::ones(1 << 20, DType::F32, pg.device())?;
            pg.barrier(&pg.default_stream()).wait()?;
            cuda.cuda_stream().synchronize().unwrap();
            let start = Instant::now();
            let busy = long_compute(pg.device(), 60)?;
            // Issued while the compute stream is busy; the comm stream waits for it by event.
            let w = pg.all_gather(
                &pg.default_stream(),
                &(input * (pg.rank() as f64))?,
                Tensor::zeros(2 << 20, DType::F32, pg.device())?,
            );
            let out = w.wait_compute()?;
            let host = start.elapsed();
            cuda.cuda_stream().synchronize().unwrap();
            let device = start.elapsed();
            let v = out.to_vec1::<f32>()?;
            assert!(v[..1 << 20].iter().all(|&x| x == 0.0));
            assert!(v[1 << 20..].iter().all(|&x| x == 1.0));
            drop(busy);
            Ok((host, device))
        })
        .unwrap();
    for (host, device) in timings {
        assert!(
            host * 4 < device,
            "issue + wait_compute took {host:?} on the host, the device {device:?}: the host \
             waited for the device"
        );
    }
}

#[test]
#[ignore = "needs a GPU; scripts/gpu-check.sh runs it"]
fn buffers_on_the_wrong_device_fail_on_every_rank() {
    let errors = gpu_threads(2).run_each(|pg| {
        let good = Tensor::zeros(4, DType::F32, pg.device())?;
        let x = if pg.rank() == 1 {
            Tensor::zeros(2, DType::F32, &Device::Cpu)?
        } else {
            Tensor::zeros(2, DType::F32, pg.device())?
        };
        let e = pg
            .all_gather(&pg.default_stream(), &x, good)
            .wait()
            .unwrap_err();
        // The group stays usable.
        let ok = pg
            .all_reduce(
                &pg.default_stream(),
                Tensor::ones(3, DType::F32, pg.device())?,
                ReduceOp::Sum,
            )
            .wait()?;
        assert_eq!(ok.to_vec1::<f32>()?, vec![2.0; 3]);
        Ok(e.to_string())
    });
    let gpu = crate::gpu();
    for e in errors {
        assert_eq!(
            e.unwrap(),
            format!(
                "all_gather #1 (stream collective) on rank 1: all_gather input: expected a \
                 tensor on this rank's device (cuda:{gpu}), found a tensor on cpu"
            )
        );
    }
    // Another rank's Candle device on the same GPU: another compute stream, refused too.
    let devices =
        candle_fsdp::comm::threads::new_group_on_gpu(2, ThreadGroupConfig::default(), gpu).unwrap();
    let foreign = Tensor::zeros(2, DType::F32, devices[1].device()).unwrap();
    let e =
        candle_fsdp::comm::threads::run_ranks_on_gpu(2, ThreadGroupConfig::default(), gpu, |pg| {
            let x = if pg.rank() == 0 {
                foreign.clone()
            } else {
                Tensor::zeros(2, DType::F32, pg.device())?
            };
            pg.all_gather(
                &pg.default_stream(),
                &x,
                Tensor::zeros(4, DType::F32, pg.device())?,
            )
            .wait()
        });
    for r in e {
        let msg = r.unwrap_err().to_string();
        assert!(msg.contains("another Candle device on cuda:"), "{msg}");
    }
}

// ---- NCCL -----------------------------------------------------------------------------------

#[cfg(feature = "nccl")]
mod nccl {
    use super::*;
    use candle_fsdp::comm::nccl::{NcclBootstrap, NcclConfig, NcclGroup};
    use candle_fsdp::comm::ProcessGroupExt;
    use candle_fsdp::Error;

    fn device() -> Device {
        candle_fsdp::device::cuda::open_device(crate::gpu()).unwrap()
    }

    fn config(timeout: Duration) -> NcclConfig {
        NcclConfig { timeout }
    }

    /// Every collective at world size 1 (identities), on the default and a new stream, and a
    /// sub-group of the one rank.
    fn world_of_one(pg: Arc<dyn ProcessGroup>) {
        assert_eq!((pg.rank(), pg.world_size(), pg.backend()), (0, 1, "nccl"));
        let dev = pg.device().clone();
        let s = pg.new_stream("all_gather").unwrap();
        let d = pg.default_stream();
        for dtype in FLOATS.iter().chain(INTS.iter()).copied() {
            let x = input(dtype, 0, 100, 7).to_device(&dev).unwrap();
            let g = pg
                .all_gather(&s, &x, Tensor::zeros(100, dtype, &dev).unwrap())
                .wait()
                .unwrap();
            assert_eq!(bits(&g), bits(&x), "{dtype:?}");
            let b = pg.broadcast(&d, x.copy().unwrap(), 0).wait().unwrap();
            assert_eq!(bits(&b), bits(&x));
            if dtype == DType::I16 {
                // NCCL has no 16-bit integers to reduce: a clear error, not a wrong result.
                let e = pg
                    .all_reduce(&d, x.copy().unwrap(), ReduceOp::Sum)
                    .wait()
                    .unwrap_err()
                    .to_string();
                assert!(e.contains("a dtype NCCL reduces"), "{e}");
                continue;
            }
            for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
                let r = pg
                    .reduce_scatter(&s, &x, Tensor::zeros(100, dtype, &dev).unwrap(), op)
                    .wait_compute()
                    .unwrap();
                assert_eq!(bits(&r), bits(&x));
                let a = pg.all_reduce(&d, x.copy().unwrap(), op).wait().unwrap();
                assert_eq!(bits(&a), bits(&x));
                let red = pg.reduce(&d, x.copy().unwrap(), 0, op).wait().unwrap();
                assert_eq!(bits(&red), bits(&x));
            }
        }
        pg.barrier(&s).wait().unwrap();
        pg.barrier(&d).wait_compute().unwrap();
        assert_eq!(
            pg.all_reduce_f32s(vec![1.5, -2.0], ReduceOp::Avg).unwrap(),
            vec![1.5, -2.0]
        );
        let sub = pg.new_group(&[0]).unwrap().expect("a member");
        let y = sub
            .all_reduce(
                &sub.default_stream(),
                Tensor::ones(5, DType::F32, &dev).unwrap(),
                ReduceOp::Sum,
            )
            .wait()
            .unwrap();
        assert_eq!(y.to_vec1::<f32>().unwrap(), vec![1.0; 5]);
        // A wrong length names this rank and the buffer, in the thread backend's wording.
        let e = pg
            .all_gather(
                &d,
                &Tensor::zeros(3, DType::F32, &dev).unwrap(),
                Tensor::zeros(4, DType::F32, &dev).unwrap(),
            )
            .wait()
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("all_gather #")
                && e.ends_with(
                    "(stream collective) on rank 0: all_gather output length: expected 3 \
                     elements (world_size 1 x input 3), found 4 elements"
                ),
            "{e}"
        );
    }

    #[test]
    #[ignore = "needs a GPU; scripts/gpu-check.sh runs it"]
    fn nccl_group_of_one_rank() {
        let g = NcclGroup::new(&device(), 0, 1, NcclBootstrap::Single, config(TIMEOUT)).unwrap();
        world_of_one(g);
    }

    #[test]
    #[ignore = "needs a GPU; scripts/gpu-check.sh runs it"]
    fn nccl_group_bootstrapped_over_the_store() {
        let port = crate::common::free_port();
        let bootstrap = NcclBootstrap::Store {
            addr: "127.0.0.1",
            port,
        };
        let g = NcclGroup::new(&device(), 0, 1, bootstrap, config(TIMEOUT)).unwrap();
        world_of_one(g.clone());
        // The launcher over the same kind of bootstrap runs the closure on this rank.
        let port2 = crate::common::free_port();
        let launcher = Launcher::Nccl {
            rank: 0,
            world_size: 1,
            gpu: crate::gpu(),
            bootstrap: NcclBootstrap::Store {
                addr: "127.0.0.1",
                port: port2,
            },
            config: config(TIMEOUT),
        };
        let v = launcher
            .run(|pg| pg.all_reduce_f32s(vec![2.0], ReduceOp::Sum))
            .unwrap();
        assert_eq!(v, vec![vec![2.0]]);
    }

    /// Holds a device's compute stream until [`Gate::open`] (or `cap`, a safety net): a
    /// one-thread kernel polling a flag in mapped host memory, so that what waits behind it is
    /// stuck for as long as the test says, whatever the GPU's clock (a fixed-length spin was
    /// not: on an H200 the "stuck" collective of this test completed within its 300 ms timeout).
    struct Gate {
        flag: *mut u32,
        /// Recorded right after the gate kernel: it has finished once this completed.
        passed: cudarc::driver::CudaEvent,
    }

    impl Gate {
        fn close(dev: &Device, cap: Duration) -> Gate {
            use cudarc::driver::{result, sys, PushKernelArg};
            let Device::Cuda(cuda) = dev else {
                panic!("a CUDA device")
            };
            let stream = cuda.cuda_stream();
            stream.context().bind_to_thread().unwrap();
            // SAFETY: 4 bytes of page-locked host memory, mapped into the device's address
            // space (DEVICEMAP); written before any kernel reads it; freed in `drop` only once
            // the kernel has finished.
            let (flag, dptr) = unsafe {
                let host = result::malloc_host(
                    4,
                    sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
                )
                .unwrap() as *mut u32;
                std::ptr::write_volatile(host, 0);
                let mut dptr: sys::CUdeviceptr = 0;
                sys::cuMemHostGetDevicePointer_v2(&mut dptr, host.cast(), 0)
                    .result()
                    .unwrap();
                (host, dptr)
            };
            let src = r#"
                extern "C" __global__ void gate(const volatile unsigned int* flag,
                                                unsigned long long cap_ns) {
                    unsigned long long start, now;
                    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
                    do {
                        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
                    } while (*flag == 0u && now - start < cap_ns);
                }"#;
            let ptx = cudarc::nvrtc::compile_ptx(src).unwrap();
            let func = cuda
                .get_or_load_custom_func("gate", "test_gate", &ptx.to_src())
                .unwrap();
            let cap_ns = cap.as_nanos() as u64;
            let mut b = func.builder();
            b.arg(&dptr);
            b.arg(&cap_ns);
            let cfg = cudarc::driver::LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (1, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the kernel reads one u32 at `dptr`, mapped host memory that lives until
            // the kernel has finished (`drop`).
            unsafe { b.launch(cfg) }.unwrap();
            let passed = stream.record_event(None).unwrap();
            Gate { flag, passed }
        }

        fn open(&self) {
            // SAFETY: the flag is live until `drop`; the kernel only reads it.
            unsafe { std::ptr::write_volatile(self.flag, 1) };
        }
    }

    impl Drop for Gate {
        fn drop(&mut self) {
            self.open();
            let deadline = Instant::now() + Duration::from_secs(60);
            while !self.passed.try_is_complete().unwrap_or(false) {
                if Instant::now() > deadline {
                    // The kernel may still read the flag: leak it rather than free it.
                    return;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            // SAFETY: the kernel that read the flag has finished.
            unsafe { cudarc::driver::result::free_host(self.flag.cast()) }.unwrap();
        }
    }

    #[test]
    #[ignore = "needs a GPU; scripts/gpu-check.sh runs it"]
    fn the_watchdog_turns_a_stuck_collective_into_a_timeout_naming_it() {
        let dev = device();
        let g = NcclGroup::new(
            &dev,
            0,
            1,
            NcclBootstrap::Single,
            config(Duration::from_millis(300)),
        )
        .unwrap();
        let pg: Arc<dyn ProcessGroup> = g;
        // One collective first, with everything the stuck one uses created beforehand: the
        // first use of a kernel (NCCL's, Candle's fill) may load it lazily, and the driver may
        // synchronise the context to do so, which would block the host behind the gate.
        let warm = pg
            .all_reduce(
                &pg.default_stream(),
                Tensor::ones(8, DType::F32, &dev).unwrap(),
                ReduceOp::Sum,
            )
            .wait()
            .unwrap();
        assert_eq!(warm.to_vec1::<f32>().unwrap(), vec![1.0; 8]);
        let x = Tensor::ones(8, DType::F32, &dev).unwrap();
        let (gx, gy) = (
            Tensor::ones(2, DType::F32, &dev).unwrap(),
            Tensor::zeros(2, DType::F32, &dev).unwrap(),
        );
        let Device::Cuda(cuda) = &dev else {
            panic!("a CUDA device")
        };
        cuda.cuda_stream().synchronize().unwrap();
        // The comm stream waits for the compute stream, held by the gate until the test opens
        // it (20 s at most): the collective cannot complete within the 300 ms timeout.
        let gate = Gate::close(&dev, Duration::from_secs(20));
        let started = Instant::now();
        let w = pg.all_reduce(&pg.default_stream(), x, ReduceOp::Sum);
        let issued = started.elapsed();
        let outcome = w.wait();
        let waited = started.elapsed();
        gate.open();
        let e = match outcome {
            Err(e) => e,
            Ok(_) => panic!(
                "the collective completed (issue took {issued:?}, the wait {waited:?}) while \
                 the compute stream it waits for was held: the host must have waited for the \
                 device while issuing it"
            ),
        };
        assert!(waited < Duration::from_secs(3), "{waited:?}");
        match &e {
            Error::Timeout { op, rank, .. } => {
                assert_eq!(
                    (op.as_str(), *rank),
                    ("all_reduce #2 (stream collective)", 0)
                )
            }
            other => panic!("expected a timeout, got {other}"),
        }
        // Every later collective fails too, naming itself and the one that timed out.
        let e = pg
            .all_gather(&pg.default_stream(), &gx, gy)
            .wait()
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(
                "all_gather #3 (stream collective) on rank 0 failed: aborted by the \
                           watchdog: all_reduce #2 (stream collective) did not complete"
            ),
            "{e}"
        );
        assert!(pg.new_stream("late").is_err());
        drop(gate);
    }

    #[test]
    #[ignore = "needs a GPU; scripts/gpu-check.sh runs it"]
    fn abort_fails_later_collectives_naming_the_rank() {
        let dev = device();
        let pg: Arc<dyn ProcessGroup> =
            NcclGroup::new(&dev, 0, 1, NcclBootstrap::Single, config(TIMEOUT)).unwrap();
        pg.abort("unit fc2: NaN loss");
        let e = pg
            .all_reduce(
                &pg.default_stream(),
                Tensor::ones(2, DType::F32, &dev).unwrap(),
                ReduceOp::Sum,
            )
            .wait()
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "all_reduce #1 (stream collective) on rank 0 aborted: rank 0 failed: unit fc2: NaN \
             loss"
        );
    }
}
