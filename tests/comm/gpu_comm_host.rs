//! The CPU-side pieces of the GPU path's communication: which launcher `--device` and the way a
//! process was started select (and the errors of impossible combinations); the bootstrap's
//! exchange over the TCP store with ranks as threads (the NCCL unique id, failure notices),
//! which needs no NCCL; and the reduction kernel of the thread backend on CUDA
//! (`kernels/comm.cu`) compiled for the host under `kernels/host/emulation.h`, bit for bit
//! against the CPU thread backend. Expectations follow the features this test is built with.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use candle_fsdp::comm::bootstrap::{
    close_inbox, inbox_key, publish_failure, share_from_rank0, wait_notice, KeyValueStore, Notice,
    MAX_REASON_BYTES, UNIQUE_ID_KEY,
};
use candle_fsdp::comm::store::TcpStore;
use candle_fsdp::comm::threads::{run_ranks_ok, ThreadGroupConfig};
use candle_fsdp::comm::ReduceOp;
use candle_fsdp::device::DeviceSpec;
use candle_fsdp::launch::{LaunchEnv, Launcher};
use candle_fsdp::Error;

const T: Duration = Duration::from_secs(60);

fn vars(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The launcher for `device` in a process whose environment is `pairs`.
fn select(
    device: &str,
    pairs: &[(&str, &str)],
    requested: Option<usize>,
) -> candle_fsdp::Result<Launcher> {
    let m = vars(pairs);
    let get = move |k: &str| m.get(k).cloned();
    let env = LaunchEnv::from_vars(&get)?;
    let device: DeviceSpec = device.parse()?;
    Launcher::for_device_with(device, &env, requested, 2, T, &get)
}

fn err(r: candle_fsdp::Result<Launcher>) -> String {
    match r {
        Ok(l) => panic!("expected an error, got {l:?}"),
        Err(e) => e.to_string(),
    }
}

const TORCHRUN_2: [(&str, &str); 6] = [
    ("RANK", "1"),
    ("WORLD_SIZE", "2"),
    ("LOCAL_RANK", "1"),
    ("LOCAL_WORLD_SIZE", "2"),
    ("MASTER_ADDR", "127.0.0.1"),
    ("MASTER_PORT", "29500"),
];

#[test]
fn cpu_runs_threads_shm_tcp_or_mpi() {
    let l = select("cpu", &[], Some(3)).unwrap();
    assert_eq!(l.backend(), "threads");
    assert_eq!((l.world_size(), l.gpu(), l.local_ranks()), (3, None, 0..3));
    assert_eq!(select("cpu", &[], None).unwrap().world_size(), 2);

    // Torchrun-style on one machine: the shared-memory backend, this process's rank only.
    let l = select("cpu", &TORCHRUN_2, None).unwrap();
    assert_eq!(l.backend(), "shm");
    assert_eq!((l.world_size(), l.gpu(), l.local_ranks()), (2, None, 1..2));
    // Several machines on CPU (LOCAL_WORLD_SIZE < WORLD_SIZE): the TCP backend, this
    // process's rank only.
    let mut two_nodes = TORCHRUN_2;
    two_nodes[1] = ("WORLD_SIZE", "4");
    let l = select("cpu", &two_nodes, None).unwrap();
    assert_eq!(l.backend(), "tcp");
    assert_eq!((l.world_size(), l.gpu(), l.local_ranks()), (4, None, 1..2));
    // Several ranks need the store's address.
    let e = err(select("cpu", &TORCHRUN_2[..4], None));
    assert!(
        e.contains("MASTER_ADDR and MASTER_PORT are not both set"),
        "{e}"
    );
    let e = err(select("cpu", &TORCHRUN_2, Some(4)));
    assert!(
        e.contains("--world-size 4 disagrees with the launcher (WORLD_SIZE=2)"),
        "{e}"
    );

    #[cfg(not(feature = "mpi"))]
    {
        let mpirun = [("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2")];
        let e = err(select("cpu", &mpirun, None));
        assert!(e.contains("built without the `mpi` feature"), "{e}");
    }
}

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_without_the_gpu_path_says_how_to_rebuild() {
    for env in [&[][..], &TORCHRUN_2[..]] {
        for device in ["cuda", "cuda:1"] {
            let e = err(select(device, env, None));
            assert!(
                e.contains(&format!("--device {device}: this build has no GPU path"))
                    && e.contains("--features cuda")
                    && e.contains("--features nccl"),
                "{e}"
            );
        }
    }
}

#[cfg(feature = "cuda")]
#[test]
fn cuda_plainly_is_threads_on_one_gpu() {
    let l = select("cuda", &[], Some(4)).unwrap();
    assert_eq!(
        l,
        Launcher::ThreadsOnGpu {
            world_size: 4,
            gpu: 0,
            config: candle_fsdp::comm::threads::ThreadGroupConfig { timeout: T },
        }
    );
    assert_eq!(
        (l.backend(), l.gpu(), l.local_ranks()),
        ("threads", Some(0), 0..4)
    );
    assert_eq!(select("cuda:1", &[], None).unwrap().gpu(), Some(1));
    // A stray LOCAL_RANK (no RANK/WORLD_SIZE) still picks the GPU of `cuda`.
    assert_eq!(
        select("cuda", &[("LOCAL_RANK", "3")], None).unwrap().gpu(),
        Some(3)
    );
    let e = err(select("cuda", &[("LOCAL_RANK", "x")], None));
    assert!(
        e.contains("environment variable LOCAL_RANK=\"x\" is not a non-negative integer"),
        "{e}"
    );
    let e = err(select("cuda", &[], Some(65)));
    assert!(e.contains("1 to 64 of them"), "{e}");
}

#[cfg(all(feature = "cuda", not(feature = "nccl")))]
#[test]
fn one_process_per_gpu_needs_nccl() {
    let e = err(select("cuda", &TORCHRUN_2, None));
    assert!(
        e.contains("started torchrun-style (RANK=1, WORLD_SIZE=2) with --device cuda")
            && e.contains("--features nccl"),
        "{e}"
    );
}

#[cfg(feature = "nccl")]
#[test]
fn torchrun_with_cuda_is_nccl_over_the_store() {
    use candle_fsdp::comm::nccl::{NcclBootstrap, NcclConfig};
    let l = select("cuda", &TORCHRUN_2, None).unwrap();
    assert_eq!(
        l,
        Launcher::Nccl {
            rank: 1,
            world_size: 2,
            gpu: 1,
            bootstrap: NcclBootstrap::Store {
                addr: "127.0.0.1",
                port: 29500
            },
            config: NcclConfig { timeout: T },
        }
    );
    assert_eq!((l.backend(), l.local_ranks()), ("nccl", 1..2));

    // Two processes on one GPU: refused, naming the way out.
    let e = err(select("cuda:0", &TORCHRUN_2, None));
    assert!(
        e.contains(
            "--device cuda:0 puts the 2 processes of this machine (LOCAL_WORLD_SIZE = 2) on GPU 0"
        ) && e.contains("NCCL refuses two ranks on one GPU")
            && e.contains("use --device cuda"),
        "{e}"
    );
    // One process per machine may pick its GPU.
    let one_per_node = [
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("LOCAL_RANK", "0"),
        ("LOCAL_WORLD_SIZE", "1"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29500"),
    ];
    assert_eq!(
        select("cuda:3", &one_per_node, None).unwrap().gpu(),
        Some(3)
    );

    // No store to bootstrap from.
    let e = err(select("cuda", &TORCHRUN_2[..4], None));
    assert!(
        e.contains("MASTER_ADDR and MASTER_PORT are not both set"),
        "{e}"
    );
    // A job of one rank needs none.
    let single = select("cuda", &[("RANK", "0"), ("WORLD_SIZE", "1")], None).unwrap();
    assert!(matches!(
        single,
        Launcher::Nccl {
            bootstrap: NcclBootstrap::Single,
            gpu: 0,
            ..
        }
    ));
}

#[cfg(feature = "nccl")]
#[test]
fn mpirun_with_cuda_is_nccl_over_mpi_or_the_store() {
    use candle_fsdp::comm::nccl::NcclBootstrap;
    let mpirun = [
        ("OMPI_COMM_WORLD_RANK", "1"),
        ("OMPI_COMM_WORLD_SIZE", "2"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
    ];
    #[cfg(feature = "mpi")]
    {
        let l = select("cuda", &mpirun, None).unwrap();
        assert!(matches!(
            l,
            Launcher::Nccl {
                rank: 1,
                gpu: 1,
                bootstrap: NcclBootstrap::Mpi,
                ..
            }
        ));
    }
    #[cfg(not(feature = "mpi"))]
    {
        let e = err(select("cuda", &mpirun, None));
        assert!(
            e.contains("started by mpirun (rank 1 of 2)")
                && e.contains("--features nccl,mpi")
                && e.contains("MASTER_ADDR and MASTER_PORT"),
            "{e}"
        );
        let mut with_store = mpirun.to_vec();
        with_store.extend([("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "1234")]);
        let l = select("cuda", &with_store, None).unwrap();
        assert!(matches!(
            l,
            Launcher::Nccl {
                bootstrap: NcclBootstrap::Store {
                    addr: "10.0.0.1",
                    port: 1234
                },
                ..
            }
        ));
    }
    // Two processes here and no local rank: which GPU?
    let e = err(select("cuda", &mpirun[..3], None));
    assert!(e.contains("set LOCAL_RANK"), "{e}");
    let e = err(select("cuda:0", &mpirun, None));
    assert!(e.contains("NCCL refuses two ranks on one GPU"), "{e}");
}

// ---- the bootstrap over the TCP store, ranks as threads ------------------------------------

use crate::common::free_port;

/// Runs `f` on `world_size` ranks (threads), each with its store client.
fn with_stores<R: Send>(
    world_size: usize,
    timeout: Duration,
    f: impl Fn(Arc<TcpStore>) -> R + Sync,
) -> Vec<R> {
    let port = free_port();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world_size)
            .map(|r| {
                let f = &f;
                s.spawn(move || {
                    let store =
                        TcpStore::connect("127.0.0.1", port, r, world_size, timeout).unwrap();
                    f(Arc::new(store))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn rank_0_shares_the_unique_id_with_every_rank() {
    let ids = with_stores(3, T, |store| {
        let made = share_from_rank0(&*store, UNIQUE_ID_KEY, 128, || {
            Ok((0..128).map(|i| (i * 7 + 3) as u8).collect())
        })
        .unwrap();
        // Keep rank 0's server up until everybody read.
        store.barrier("read").unwrap();
        made
    });
    let expected: Vec<u8> = (0..128).map(|i| (i * 7 + 3) as u8).collect();
    assert_eq!(ids, vec![expected; 3]);
}

#[test]
fn a_failure_of_rank_0_reaches_the_others_at_once() {
    let results = with_stores(3, T, |store| {
        let r = share_from_rank0(&*store, "id", 128, || {
            Err(Error::Nccl {
                call: "ncclGetUniqueId".into(),
                rank: 0,
                message: "libnccl.so not found".into(),
            })
        });
        store.barrier("read").unwrap();
        r.map_err(|e| e.to_string())
    });
    assert_eq!(
        results[0].as_ref().unwrap_err(),
        "ncclGetUniqueId on rank 0 failed: libnccl.so not found"
    );
    for (r, res) in results.iter().enumerate().skip(1) {
        assert_eq!(
            res.as_ref().unwrap_err(),
            &format!(
                "bootstrap (store key \"id\") on rank {r} aborted: rank 0 failed: ncclGetUniqueId \
                 on rank 0 failed: libnccl.so not found"
            )
        );
    }
}

#[test]
fn a_value_of_the_wrong_length_is_refused() {
    let results = with_stores(2, T, |store| {
        let r = if store.rank() == 0 {
            store.set("id", &[0u8; 5]).map(|()| Vec::new())
        } else {
            share_from_rank0(&*store, "id", 128, || unreachable!())
        };
        store.barrier("read").unwrap();
        r.map_err(|e| e.to_string())
    });
    assert_eq!(
        results[1].as_ref().unwrap_err(),
        "invalid argument: store key \"id\": expected 128 bytes, found 4"
    );
    // Rank 0's own value is checked too.
    let results = with_stores(1, T, |store| {
        share_from_rank0(&*store, "id", 128, || Ok(vec![1, 2, 3])).map_err(|e| e.to_string())
    });
    assert_eq!(
        results[0].as_ref().unwrap_err(),
        "invalid argument: store key \"id\": expected 128 bytes, found 3"
    );
}

#[test]
fn a_failure_notice_reaches_every_other_rank_and_closing_stops_a_watcher() {
    let notices = with_stores(3, T, |store| {
        store.barrier("joined").unwrap();
        if store.rank() == 1 {
            publish_failure(&*store, 1, "unit fc2: NaN in the loss").unwrap();
            // Its own inbox stays empty: closing it is what stops its watcher.
            close_inbox(&*store).unwrap();
        }
        let n = wait_notice(&*store).unwrap();
        store.barrier("read").unwrap();
        n
    });
    let failed = Notice::Failed {
        rank: 1,
        reason: "unit fc2: NaN in the loss".into(),
    };
    assert_eq!(notices, vec![failed.clone(), Notice::Closed, failed]);
}

#[test]
fn notices_round_trip_and_garbage_is_refused() {
    for n in [
        Notice::Closed,
        Notice::Failed {
            rank: 12,
            reason: "line 1\nline 2: é".into(),
        },
        Notice::Failed {
            rank: 0,
            reason: String::new(),
        },
    ] {
        assert_eq!(Notice::decode(&n.encode()).unwrap(), n);
    }
    for bad in [&b"failed x\nwhy"[..], b"failed 1", b"hello", b""] {
        let e = Notice::decode(bad).unwrap_err().to_string();
        assert!(e.contains("not a failure notice"), "{e}");
    }
    assert_eq!(inbox_key(3), "candle-fsdp/notice/3");
}

#[test]
fn long_reasons_are_cut_at_a_character_boundary() {
    let reason = "é".repeat(MAX_REASON_BYTES); // 2 bytes each
    let notices = with_stores(2, T, |store| {
        if store.rank() == 0 {
            publish_failure(&*store, 0, &reason).unwrap();
            store.barrier("read").unwrap();
            None
        } else {
            let n = wait_notice(&*store).unwrap();
            store.barrier("read").unwrap();
            Some(n)
        }
    });
    match &notices[1] {
        Some(Notice::Failed { rank: 0, reason }) => {
            assert_eq!(reason.len(), MAX_REASON_BYTES);
            assert!(reason.chars().all(|c| c == 'é'));
        }
        other => panic!("{other:?}"),
    }
}

/// A store of this test, to check that the protocol needs nothing of TCP.
#[derive(Default)]
struct MemStore {
    map: std::sync::Mutex<HashMap<String, Vec<u8>>>,
}

impl KeyValueStore for MemStore {
    fn set(&self, key: &str, value: &[u8]) -> candle_fsdp::Result<()> {
        self.map.lock().unwrap().insert(key.into(), value.to_vec());
        Ok(())
    }
    fn get(&self, key: &str) -> candle_fsdp::Result<Vec<u8>> {
        self.map
            .lock()
            .unwrap()
            .get(key)
            .cloned()
            .ok_or_else(|| Error::InvalidArgument(format!("{key} not set")))
    }
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        4
    }
}

#[test]
fn publishing_fills_every_other_inbox() {
    let s = MemStore::default();
    publish_failure(&s, 2, "boom").unwrap();
    let map = s.map.lock().unwrap();
    let mut keys: Vec<&String> = map.keys().collect();
    keys.sort();
    assert_eq!(
        keys,
        [
            "candle-fsdp/notice/0",
            "candle-fsdp/notice/1",
            "candle-fsdp/notice/3"
        ]
    );
    let failed = Notice::Failed {
        rank: 2,
        reason: "boom".into(),
    };
    assert_eq!(
        Notice::decode(&map["candle-fsdp/notice/0"]).unwrap(),
        failed
    );
}

// ---- the reduction kernel under host emulation --------------------------------------------

/// `kernels/comm.cu` (after `kernels/common.cuh`, as the loader does) under
/// `kernels/host/emulation.h`, built as a shared library with one C entry point; `Err` (the
/// reason) when no C++ compiler runs here.
struct EmulatedComm(*mut libc::c_void);

/// `emu_comm_reduce(dtype code, sources, nsrc, dst, n, op, use_scale, scale_f, scale_d, grid,
/// block)`: one emulated launch of `comm_reduce_<dtype>`.
type ReduceFn = unsafe extern "C" fn(u32, *const u64, u32, u64, u64, i32, i32, f32, f64, u32, u32);

const LAUNCH_CPP: &str = r#"
#include "KERNELS/host/emulation.h"
#include "KERNELS/common.cuh"
#include "KERNELS/comm.cu"
extern "C" void emu_comm_reduce(unsigned dtype, const unsigned long long* srcs, unsigned nsrc,
                                unsigned long long dst, unsigned long long n, int op,
                                int use_scale, float sf, double sd, unsigned gx, unsigned bx) {
    CommSrcs s;
    for (unsigned i = 0; i < COMM_MAX_RANKS; i++) s.p[i] = i < nsrc ? srcs[i] : 0ull;
    switch (dtype) {
    case 0: EMU_LAUNCH(gx, 1u, bx, comm_reduce_f32(s, nsrc, (float*)dst, n, op, use_scale, sf, sd)); break;
    case 1: EMU_LAUNCH(gx, 1u, bx, comm_reduce_f64(s, nsrc, (double*)dst, n, op, use_scale, sf, sd)); break;
    case 2: EMU_LAUNCH(gx, 1u, bx, comm_reduce_bf16(s, nsrc, (u16*)dst, n, op, use_scale, sf, sd)); break;
    case 3: EMU_LAUNCH(gx, 1u, bx, comm_reduce_f16(s, nsrc, (u16*)dst, n, op, use_scale, sf, sd)); break;
    case 4: EMU_LAUNCH(gx, 1u, bx, comm_reduce_u8(s, nsrc, (unsigned char*)dst, n, op, use_scale, sf, sd)); break;
    case 5: EMU_LAUNCH(gx, 1u, bx, comm_reduce_u32(s, nsrc, (unsigned int*)dst, n, op, use_scale, sf, sd)); break;
    case 6: EMU_LAUNCH(gx, 1u, bx, comm_reduce_i16(s, nsrc, (short*)dst, n, op, use_scale, sf, sd)); break;
    case 7: EMU_LAUNCH(gx, 1u, bx, comm_reduce_i32(s, nsrc, (int*)dst, n, op, use_scale, sf, sd)); break;
    default: EMU_LAUNCH(gx, 1u, bx, comm_reduce_i64(s, nsrc, (long long*)dst, n, op, use_scale, sf, sd)); break;
    }
}
"#;

const DTYPES: [DType; 9] = [
    DType::F32,
    DType::F64,
    DType::BF16,
    DType::F16,
    DType::U8,
    DType::U32,
    DType::I16,
    DType::I32,
    DType::I64,
];

impl EmulatedComm {
    fn build() -> Result<EmulatedComm, String> {
        let kernels = concat!(env!("CARGO_MANIFEST_DIR"), "/kernels");
        if !std::path::Path::new(kernels)
            .join("host/emulation.h")
            .is_file()
        {
            return Err("kernels/host/emulation.h is missing".into());
        }
        let dir = std::env::temp_dir().join(format!("candle-fsdp-comm-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let src = dir.join("comm_launch.cpp");
        std::fs::write(&src, LAUNCH_CPP.replace("KERNELS", kernels)).map_err(|e| e.to_string())?;
        let lib = dir.join("libcomm_emulated.so");
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let out = std::process::Command::new(&cxx)
            .args([
                "-O2",
                "-std=c++17",
                "-ffp-contract=off",
                "-fno-fast-math",
                "-fPIC",
            ])
            .args(["-shared", "-w", "-o"])
            .arg(&lib)
            .arg(&src)
            .output()
            .map_err(|e| format!("no C++ compiler ({cxx}: {e})"))?;
        assert!(
            out.status.success(),
            "{cxx} failed on kernels/comm.cu under emulation:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let c = std::ffi::CString::new(lib.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path of the library just built.
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        let _ = std::fs::remove_dir_all(&dir);
        assert!(!h.is_null(), "dlopen of the emulated comm kernel failed");
        Ok(EmulatedComm(h))
    }

    fn reduce(&self) -> ReduceFn {
        let name = std::ffi::CString::new("emu_comm_reduce").unwrap();
        // SAFETY: a live handle and a valid name.
        let s = unsafe { libc::dlsym(self.0, name.as_ptr()) };
        assert!(!s.is_null(), "no emu_comm_reduce");
        // SAFETY: `ReduceFn` is the C signature of emu_comm_reduce above.
        unsafe { std::mem::transmute::<*mut libc::c_void, ReduceFn>(s) }
    }
}

/// The bytes of a CPU tensor's elements (little-endian, as in memory).
fn raw_bytes(t: &Tensor) -> Vec<u8> {
    macro_rules! le {
        ($t:ty, $f:expr) => {
            t.to_vec1::<$t>()
                .unwrap()
                .into_iter()
                .flat_map($f)
                .collect()
        };
    }
    match t.dtype() {
        DType::F32 => le!(f32, |x: f32| x.to_le_bytes()),
        DType::F64 => le!(f64, |x: f64| x.to_le_bytes()),
        DType::BF16 => le!(half::bf16, |x: half::bf16| x.to_bits().to_le_bytes()),
        DType::F16 => le!(half::f16, |x: half::f16| x.to_bits().to_le_bytes()),
        DType::U8 => t.to_vec1::<u8>().unwrap(),
        DType::U32 => le!(u32, |x: u32| x.to_le_bytes()),
        DType::I16 => le!(i16, |x: i16| x.to_le_bytes()),
        DType::I32 => le!(i32, |x: i32| x.to_le_bytes()),
        DType::I64 => le!(i64, |x: i64| x.to_le_bytes()),
        other => panic!("{other:?}"),
    }
}

/// 8-byte aligned memory holding `bytes` (what the kernel dereferences).
fn aligned(bytes: &[u8]) -> Vec<u64> {
    let mut v = vec![0u64; bytes.len().div_ceil(8)];
    // SAFETY: `v` holds at least `bytes.len()` bytes; the ranges do not overlap.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), v.as_mut_ptr() as *mut u8, bytes.len())
    };
    v
}

/// Rank `r`'s input: `len` values of `dtype` over a wide range of magnitudes (sums round
/// differently in another order; u8 and i16 sums wrap).
fn rank_input(dtype: DType, r: usize, len: usize, salt: u64) -> Tensor {
    let vals: Vec<f64> = (0..len)
        .map(|i| {
            let mut h = (r as u64 * 7919 + i as u64 * 104_729 + salt * 1_299_709)
                .wrapping_mul(0x9E37_79B9_7F4A_7C15);
            h ^= h >> 29;
            let m = (h % 20_001) as f64 / 10_000.0 - 1.0;
            m * 10f64.powi(((h >> 17) % 7) as i32 - 3)
        })
        .collect();
    let f32s = || vals.iter().map(|&v| v as f32).collect::<Vec<f32>>();
    let cpu = &Device::Cpu;
    match dtype {
        DType::F64 => Tensor::new(vals.clone(), cpu),
        DType::F32 | DType::BF16 | DType::F16 => {
            Tensor::new(f32s(), cpu).and_then(|t| t.to_dtype(dtype))
        }
        DType::U8 => Tensor::new(
            vals.iter()
                .map(|&v| ((v * 1e3).abs() as u64 % 256) as u8)
                .collect::<Vec<_>>(),
            cpu,
        ),
        DType::U32 => Tensor::new(
            vals.iter()
                .map(|&v| (v * 1e6).abs() as u32)
                .collect::<Vec<_>>(),
            cpu,
        ),
        DType::I16 => Tensor::new(
            vals.iter()
                .map(|&v| ((v * 1e3) as i64 % 30_000) as i16)
                .collect::<Vec<_>>(),
            cpu,
        ),
        DType::I32 => Tensor::new(
            vals.iter().map(|&v| (v * 1e6) as i32).collect::<Vec<_>>(),
            cpu,
        ),
        DType::I64 => Tensor::new(
            vals.iter().map(|&v| (v * 1e9) as i64).collect::<Vec<_>>(),
            cpu,
        ),
        other => panic!("{other:?}"),
    }
    .unwrap()
}

/// The reduction kernel of the thread backend on CUDA, run on the host, gives every rank's
/// reduce-scatter chunk bit for bit as the CPU thread backend does: every dtype and reduce op,
/// world sizes 1 to 5 (Avg's scale skipped at 1), grids smaller than the data (the
/// grid-stride loop).
#[test]
fn the_cuda_reduction_kernel_matches_the_cpu_backend_under_emulation() {
    let emu = match EmulatedComm::build() {
        Ok(e) => e,
        Err(why) => {
            println!(
                "SKIPPED the_cuda_reduction_kernel_matches_the_cpu_backend_under_emulation: {why}"
            );
            return;
        }
    };
    let reduce = emu.reduce();
    let n = 37;
    for (code, dtype) in DTYPES.iter().copied().enumerate() {
        let ops: &[(ReduceOp, i32)] = if dtype.is_float() {
            &[
                (ReduceOp::Sum, 0),
                (ReduceOp::Avg, 0),
                (ReduceOp::Max, 1),
                (ReduceOp::Min, 2),
            ]
        } else {
            &[(ReduceOp::Sum, 0), (ReduceOp::Max, 1), (ReduceOp::Min, 2)]
        };
        for &(op, op_code) in ops {
            for ws in 1..=5usize {
                let salt = code as u64 * 10 + op_code as u64;
                let cpu = run_ranks_ok(ws, ThreadGroupConfig { timeout: T }, |pg| {
                    let x = rank_input(dtype, pg.rank(), ws * n, salt);
                    let out = Tensor::zeros(n, dtype, &Device::Cpu)?;
                    let y = pg
                        .reduce_scatter(&pg.default_stream(), &x, out, op)
                        .wait()?;
                    Ok(raw_bytes(&y))
                })
                .unwrap();
                let inputs: Vec<Vec<u64>> = (0..ws)
                    .map(|r| aligned(&raw_bytes(&rank_input(dtype, r, ws * n, salt))))
                    .collect();
                let size = dtype.size_in_bytes();
                for (r, expected) in cpu.iter().enumerate() {
                    let srcs: Vec<u64> = inputs
                        .iter()
                        .map(|v| v.as_ptr() as u64 + (r * n * size) as u64)
                        .collect();
                    let mut out = vec![0u64; (n * size).div_ceil(8)];
                    let use_scale = i32::from(op == ReduceOp::Avg && ws > 1);
                    // SAFETY: every source holds ws * n elements of `dtype` (its chunk r starts
                    // r * n in), the destination n; all live across the call.
                    unsafe {
                        reduce(
                            code as u32,
                            srcs.as_ptr(),
                            ws as u32,
                            out.as_mut_ptr() as u64,
                            n as u64,
                            op_code,
                            use_scale,
                            1.0 / ws as f32,
                            1.0 / ws as f64,
                            2,
                            8,
                        )
                    };
                    // SAFETY: `out` holds at least n * size bytes.
                    let got =
                        unsafe { std::slice::from_raw_parts(out.as_ptr() as *const u8, n * size) };
                    assert_eq!(
                        got,
                        &expected[..],
                        "{dtype:?} {op:?} world size {ws} rank {r}"
                    );
                }
            }
        }
    }
}
