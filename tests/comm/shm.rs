//! The shared-memory backend (`comm::shm`): ranks as processes of this test binary (re-executed
//! with torchrun-style variables, so `Launcher::from_env` picks the backend as under
//! `fsdp-run`), each checking its results bit for bit against the thread backend's run of the
//! same job in its own process; a rank killed with SIGKILL or failing with an error stops its
//! peers promptly with an error naming it. The TCP backend's tests (`super::tcp`) run the
//! same jobs with `LOCAL_WORLD_SIZE=1` in every process, which makes the launcher pick the TCP
//! backend on one machine ([`Backend::Tcp`]).

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use candle_fsdp::comm::threads::{run_ranks_ok, ThreadGroupConfig};
use candle_fsdp::comm::{ProcessGroup, ProcessGroupExt, ReduceOp};
use candle_fsdp::launch::Launcher;
use candle_fsdp::{Error, Result};

/// Values of every magnitude, different on every rank, so that the order of a reduction shows
/// in its bits.
fn data(rank: usize, seed: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let k = (i * 7919 + seed * 104_729 + rank * 31) % 1000;
            let scale = [1e-3f32, 1.0, 1e3][(i + rank) % 3];
            (k as f32 * 1.37e-3 - 0.61) * scale
        })
        .collect()
}

fn tensor(rank: usize, seed: usize, n: usize, dtype: DType) -> Result<Tensor> {
    Ok(Tensor::from_vec(data(rank, seed, n), n, &Device::Cpu)?.to_dtype(dtype)?)
}

/// The bits of `t` (every dtype used here is exact in f64).
fn bits(t: &Tensor) -> Result<Vec<u64>> {
    Ok(t.to_dtype(DType::F64)?
        .to_vec1::<f64>()?
        .into_iter()
        .map(f64::to_bits)
        .collect())
}

/// Every collective of the contract on a few streams, a sub-group, segments grown past their
/// first size, and a mismatch (the same error on every rank, the group usable afterwards):
/// named results, as bits.
pub(crate) fn exercise(pg: Arc<dyn ProcessGroup>) -> Result<Vec<(String, Vec<u64>)>> {
    let (r, ws) = (pg.rank(), pg.world_size());
    let mut out = Vec::new();
    let ag = pg.new_stream("all_gather")?;
    let rs = pg.new_stream("reduce_scatter")?;
    let def = pg.default_stream();
    let zeros = |n: usize, dtype| Tensor::zeros(n, dtype, &Device::Cpu);
    for (dtype, n) in [(DType::F32, 1000), (DType::BF16, 300_001)] {
        let input = tensor(r, 1, n, dtype)?;
        let o = pg.all_gather(&ag, &input, zeros(n * ws, dtype)?).wait()?;
        out.push((format!("all_gather {dtype:?}"), bits(&o)?));
    }
    for (dtype, n, op) in [
        (DType::F32, 700_000, ReduceOp::Sum),
        (DType::BF16, 1000, ReduceOp::Avg),
        (DType::F16, 999, ReduceOp::Max),
    ] {
        let input = tensor(r, 2, n * ws, dtype)?;
        let o = pg
            .reduce_scatter(&rs, &input, zeros(n, dtype)?, op)
            .wait()?;
        out.push((format!("reduce_scatter {dtype:?} {op:?}"), bits(&o)?));
    }
    for (dtype, n, op) in [
        (DType::F32, 1_000_003, ReduceOp::Sum),
        (DType::BF16, 77, ReduceOp::Avg),
        (DType::F64, 5, ReduceOp::Min),
    ] {
        let o = pg.all_reduce(&def, tensor(r, 3, n, dtype)?, op).wait()?;
        out.push((format!("all_reduce {dtype:?} {op:?}"), bits(&o)?));
    }
    let o = pg
        .broadcast(&def, tensor(r, 4, 5000, DType::F32)?, ws - 1)
        .wait()?;
    out.push(("broadcast".into(), bits(&o)?));
    let o = pg
        .reduce(&def, tensor(r, 5, 4096, DType::F32)?, 0, ReduceOp::Sum)
        .wait()?;
    out.push(("reduce".into(), bits(&o)?));
    let ints = Tensor::from_vec(vec![r as i64 * 1_000_000_007, -3, 7], 3, &Device::Cpu)?;
    let o = pg.all_reduce(&def, ints, ReduceOp::Sum).wait()?;
    out.push(("all_reduce i64".into(), bits(&o)?));
    pg.barrier(&ag).wait()?;
    // A stream whose name is longer than a collective's descriptor.
    let long = pg.new_stream(&"a-long-stream-name-".repeat(20))?;
    pg.barrier(&long).wait()?;
    // A mismatch: the same error on every rank, and the group still works.
    let e = pg
        .all_reduce(&def, tensor(r, 6, 10 + r, DType::F32)?, ReduceOp::Sum)
        .wait()
        .unwrap_err();
    out.push((format!("mismatch: {e}"), Vec::new()));
    let v = pg.all_reduce_f32s(data(r, 7, 9), ReduceOp::Sum)?;
    out.push((
        "after the mismatch".into(),
        v.iter().map(|x| x.to_bits() as u64).collect(),
    ));
    // A sub-group of the last and the first rank, in that order.
    if let Some(sub) = pg.new_group(&[ws - 1, 0])? {
        let v = sub.all_gather_f32s(&data(r, 8, 3))?;
        out.push((
            format!("sub-group rank {}", sub.rank()),
            v.iter().map(|x| x.to_bits() as u64).collect(),
        ));
    }
    Ok(out)
}

/// The shared-memory group's in-place path (`candle_fsdp::alloc::SharedLarge`, installed in
/// this binary): large tensors made inside `in_shared` after the group come from this
/// process's arena and are read by the peers in place; `early` (made before the group, on
/// shm) is outside it and is copied into the segment. Even ranks use `early` where given, odd
/// ones arena tensors, so each collective mixes both ways; then a sub-group. Named results,
/// as bits.
fn in_arena_and_not(
    pg: Arc<dyn ProcessGroup>,
    early: Option<Tensor>,
) -> Result<Vec<(String, Vec<u64>)>> {
    let (r, ws) = (pg.rank(), pg.world_size());
    let n = 3 * 300_000;
    let on_shm = early.is_some();
    let before = candle_fsdp::alloc::shared_bytes();
    let late = candle_fsdp::alloc::in_shared(|| tensor(r, 9, n, DType::F32))?;
    if on_shm {
        // The arena holds the new tensor.
        assert!(
            candle_fsdp::alloc::shared_bytes() >= before + 4 * n,
            "rank {r}: {} bytes in the arena after a {}-byte tensor (was {before})",
            candle_fsdp::alloc::shared_bytes(),
            4 * n
        );
        // Outside `in_shared`, large tensors stay with the wrapped allocator.
        let now = candle_fsdp::alloc::shared_bytes();
        let outside = tensor(r, 11, n, DType::F32)?;
        assert_eq!(candle_fsdp::alloc::shared_bytes(), now, "rank {r}");
        drop(outside);
    }
    let input = match early {
        Some(t) if r % 2 == 0 => t,
        _ => late,
    };
    let s = pg.default_stream();
    let mut out = Vec::new();
    let o = pg.all_gather(&s, &input, Tensor::zeros(n * ws, DType::F32, &Device::Cpu)?);
    out.push(("all_gather".to_string(), bits(&o.wait()?)?));
    let chunk = n / ws;
    let o = pg.reduce_scatter(
        &s,
        &input.narrow(0, 0, chunk * ws)?,
        Tensor::zeros(chunk, DType::F32, &Device::Cpu)?,
        ReduceOp::Sum,
    );
    out.push(("reduce_scatter".to_string(), bits(&o.wait()?)?));
    let o = pg.all_reduce(&s, input.copy()?, ReduceOp::Avg).wait()?;
    out.push(("all_reduce".to_string(), bits(&o)?));
    // The input itself in place (all-reduce writes its buffer), then read back.
    let o = pg.all_reduce(&s, input, ReduceOp::Max).wait()?;
    out.push(("all_reduce in place".to_string(), bits(&o)?));
    let o = candle_fsdp::alloc::in_shared(|| o.affine(2.0, 1.0))?;
    let o = pg.broadcast(&s, o, 0).wait()?;
    out.push(("broadcast".to_string(), bits(&o)?));
    // A sub-group of the last and the first rank, in that order (its ranks' arenas are the
    // root group's).
    if let Some(sub) = pg.new_group(&[ws - 1, 0])? {
        let piece = candle_fsdp::alloc::in_shared(|| tensor(r, 10, n, DType::F32))?;
        let s = sub.default_stream();
        let o = sub.all_gather(&s, &piece, Tensor::zeros(2 * n, DType::F32, &Device::Cpu)?);
        out.push((format!("sub-group rank {}", sub.rank()), bits(&o.wait()?)?));
    }
    Ok(out)
}

/// `got` (this backend's named results) equals `want` (the thread backend's), name for name and
/// bit for bit.
fn assert_same_bits(rank: usize, got: &[(String, Vec<u64>)], want: &[(String, Vec<u64>)]) {
    assert_eq!(got.len(), want.len(), "rank {rank}: number of results");
    for ((name, g), (wname, w)) in got.iter().zip(want) {
        assert_eq!(name, wname);
        assert!(
            g == w,
            "rank {rank}: {name} differs from the thread backend"
        );
    }
}

/// The backend a job of [`spawn_job_on`] runs on.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Backend {
    /// Every process says it shares the machine with the others (`LOCAL_WORLD_SIZE` = world
    /// size): the shared-memory backend.
    Shm,
    /// Every process says it is alone on its machine (`LOCAL_WORLD_SIZE=1`, as on separate
    /// machines): the TCP backend, over the loopback interface.
    Tcp,
}

/// Starts this binary's `helper_shm_rank` as `world_size` processes (torchrun-style variables,
/// the store on a free port) on `backend`; returns (exit code, output) of each (at most 60 s in
/// all).
///
/// On TCP, rank 0 finds its address through `FSDP_TCP_IFNAME=lo`, rank 1 through
/// `FSDP_TCP_ADDR=localhost` (a name to resolve), the others by the route toward the store:
/// every way of choosing the address is used by every job.
pub(crate) fn spawn_job_on(backend: Backend, world_size: usize, mode: &str) -> Vec<(i32, String)> {
    spawn_job_with(backend, world_size, mode, |rank| match (backend, rank) {
        (Backend::Tcp, 0) => vec![("FSDP_TCP_IFNAME", "lo".to_string())],
        (Backend::Tcp, 1) => vec![("FSDP_TCP_ADDR", "localhost".to_string())],
        _ => Vec::new(),
    })
}

/// [`spawn_job_on`] with the variables `env(rank)` added to each rank's environment.
pub(crate) fn spawn_job_with(
    backend: Backend,
    world_size: usize,
    mode: &str,
    env: impl Fn(usize) -> Vec<(&'static str, String)>,
) -> Vec<(i32, String)> {
    let local = |rank: usize| match backend {
        Backend::Shm => (rank, world_size, "shm"),
        Backend::Tcp => (0, 1, "tcp"),
    };
    let port = crate::common::free_port().to_string();
    let children: Vec<_> = (0..world_size)
        .map(|rank| {
            let (local_rank, local_ws, name) = local(rank);
            Command::new(std::env::current_exe().unwrap())
                .args([
                    "--ignored",
                    "--exact",
                    &crate::common::test_path(module_path!(), "helper_shm_rank"),
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world_size.to_string())
                .env("LOCAL_RANK", local_rank.to_string())
                .env("LOCAL_WORLD_SIZE", local_ws.to_string())
                .env("SHM_TEST_BACKEND", name)
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("SHM_TEST_MODE", mode)
                .env_remove("FSDP_TCP_ADDR")
                .env_remove("FSDP_TCP_IFNAME")
                .envs(env(rank))
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    crate::store::wait_all(children)
}

#[test]
#[ignore = "a rank process of the shm_* tests"]
fn helper_shm_rank() {
    let mode = std::env::var("SHM_TEST_MODE").unwrap();
    let launcher = Launcher::from_env(None, 1, Duration::from_secs(60)).unwrap();
    let backend = std::env::var("SHM_TEST_BACKEND").unwrap();
    assert_eq!(launcher.backend(), backend);
    let rank = launcher.local_ranks().start;
    let ws = launcher.world_size();
    match mode.as_str() {
        "exact" => {
            let got = launcher.run(exercise).unwrap().remove(0);
            let want = run_ranks_ok(ws, ThreadGroupConfig::default(), exercise)
                .unwrap()
                .swap_remove(rank);
            assert_same_bits(rank, &got, &want);
            println!(
                "rank {rank}: {} results bitwise equal to the thread backend's",
                got.len()
            );
        }
        "leave" => {
            launcher
                .run(|pg| {
                    pg.all_reduce_f32s(vec![1.0; 4], ReduceOp::Sum)?;
                    if pg.rank() == 1 {
                        // Done: the group is dropped without an error.
                        return Ok(());
                    }
                    let start = Instant::now();
                    let e = pg.all_reduce_f32s(vec![1.0; 4], ReduceOp::Sum).unwrap_err();
                    println!(
                        "rank {}: failed after {:.1} s: {e}",
                        pg.rank(),
                        start.elapsed().as_secs_f64()
                    );
                    Ok(())
                })
                .unwrap();
        }
        "die" | "fail" => {
            let result = launcher.run(|pg| {
                pg.all_reduce_f32s(vec![1.0; 4], ReduceOp::Sum)?;
                if pg.rank() == 1 {
                    if mode == "die" {
                        // SAFETY: plain syscall: this process kills itself.
                        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
                    }
                    return Err(Error::InvalidArgument("rank 1 gives up".into()));
                }
                let start = Instant::now();
                let e = pg.all_reduce_f32s(vec![1.0; 4], ReduceOp::Sum).unwrap_err();
                println!(
                    "rank {}: failed after {:.1} s: {e}",
                    pg.rank(),
                    start.elapsed().as_secs_f64()
                );
                Ok(())
            });
            if let Err(e) = result {
                println!("rank {rank}: error: {e}");
            }
        }
        "arena" => {
            // Made before the group: outside the arena, so copied into this rank's segment.
            let early = tensor(rank, 9, 3 * 300_000, DType::F32).unwrap();
            let got = launcher
                .run(|pg| in_arena_and_not(pg, Some(early.clone())))
                .unwrap()
                .remove(0);
            let want = run_ranks_ok(ws, ThreadGroupConfig::default(), |pg| {
                in_arena_and_not(pg, None)
            })
            .unwrap()
            .swap_remove(rank);
            assert_same_bits(rank, &got, &want);
            println!("rank {rank}: {} arena results bitwise equal", got.len());
        }
        "long" => {
            // A stream name longer than the backend's descriptor limit, on every rank.
            let name = "n".repeat(if backend == "tcp" { 1_100_000 } else { 8_000 });
            let (e, sum) = launcher
                .run(|pg| {
                    let e = pg.new_stream(&name).map(|_| ()).unwrap_err();
                    // Refused alike on every rank: the group stays usable.
                    Ok((e, pg.all_reduce_f32s(vec![1.0], ReduceOp::Sum)?))
                })
                .unwrap()
                .remove(0);
            println!("rank {rank}: error: {e}");
            println!("rank {rank}: then all_reduce {sum:?}");
        }
        "connect" => match launcher.run(|_| Ok(())) {
            Ok(_) => println!("rank {rank}: connected"),
            Err(e) => println!("rank {rank}: connect error: {e}"),
        },
        other => panic!("unknown mode {other}"),
    }
}

/// A setup argument over the backend's descriptor limit: on every rank the same error naming
/// the argument's size and the limit (`tail`), after which the group still works.
pub(crate) fn check_too_long(backend: Backend, tail: &str) {
    for (r, (code, out)) in spawn_job_on(backend, 2, "long").iter().enumerate() {
        assert_eq!(*code, 0, "rank {r}:\n{out}");
        // The name quoted short (its first 48 bytes and its length), the output a pipe's worth.
        let bytes = if backend == Backend::Tcp {
            1_100_000
        } else {
            8_000
        };
        let name = format!("{}… ({bytes} bytes)", "n".repeat(48));
        let error = format!("rank {r}: error: new_stream #1 ({name:?}) on rank 0: {tail}\n");
        let then = format!("rank {r}: then all_reduce [2.0]");
        assert!(
            out.contains(&error) && out.contains(&then),
            "rank {r}:\n{out}"
        );
    }
}

#[test]
fn shm_a_setup_argument_over_the_limit_is_one_error_naming_it() {
    check_too_long(
        Backend::Shm,
        "new_stream setup argument: expected at most 7156 bytes (the backend's limit: a \
         descriptor of at most 7168 bytes), found 8000 bytes (a descriptor of 8012 bytes)",
    );
}

#[test]
fn shm_collectives_are_bitwise_the_thread_backends() {
    check_exact(Backend::Shm);
}

#[test]
fn shm_a_bad_arena_switch_is_an_error_naming_it() {
    let env = |_| vec![("FSDP_SHM_ARENA", "maybe".to_string())];
    for (r, (code, out)) in spawn_job_with(Backend::Shm, 2, "connect", env)
        .into_iter()
        .enumerate()
    {
        assert_eq!(code, 0, "rank {r}: {out}");
        assert!(
            out.contains(&format!("rank {r}: connect error: "))
                && out.contains("FSDP_SHM_ARENA")
                && out.contains("\"maybe\"")
                && out.contains("0/false/off/no"),
            "rank {r}: {out}"
        );
    }
}

#[test]
fn shm_reads_arena_tensors_in_place_and_copies_the_others_bitwise_the_thread_backends() {
    for (r, (code, out)) in spawn_job_on(Backend::Shm, 3, "arena")
        .into_iter()
        .enumerate()
    {
        assert_eq!(code, 0, "rank {r}: {out}");
        assert!(
            out.contains(&format!(
                "rank {r}: {} arena results bitwise equal",
                if r == 1 { 5 } else { 6 }
            )),
            "{out}"
        );
    }
}

/// A job of 3 ranks on `backend` runs [`exercise`]; every rank's results equal the thread
/// backend's bit for bit.
pub(crate) fn check_exact(backend: Backend) {
    for (r, (code, out)) in spawn_job_on(backend, 3, "exact").into_iter().enumerate() {
        assert_eq!(code, 0, "rank {r}:\n{out}");
        // 13 results, and the sub-group's on its members (ranks 2 and 0).
        let n = if r == 1 { 13 } else { 14 };
        assert!(
            out.contains(&format!(
                "rank {r}: {n} results bitwise equal to the thread backend's"
            )),
            "rank {r}:\n{out}"
        );
    }
}

/// Rank `r`'s `rank r: failed after …` line (libtest's "test helper_shm_rank ... " may precede
/// it).
pub(crate) fn failure_line(out: &str, r: usize) -> &str {
    let start = format!("rank {r}: failed after");
    out.lines()
        .find_map(|l| l.find(&start).map(|i| &l[i..]))
        .unwrap_or_else(|| panic!("{out}"))
}

/// Seconds of a failure line.
pub(crate) fn failure_secs(line: &str, r: usize) -> f64 {
    line[format!("rank {r}: failed after ").len()..]
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn shm_a_rank_killed_with_sigkill_stops_its_peers_promptly() {
    check_killed(Backend::Shm, 2);
}

/// Rank 1 of `world_size` kills itself with SIGKILL between two collectives: every other rank
/// fails within 5 s with an error naming rank 1 and saying its process ended.
pub(crate) fn check_killed(backend: Backend, world_size: usize) {
    let results = spawn_job_on(backend, world_size, "die");
    assert_eq!(
        results[1].0, -1,
        "rank 1 died by a signal:\n{}",
        results[1].1
    );
    for (r, (code, out)) in results.iter().enumerate().filter(|(r, _)| *r != 1) {
        assert_eq!(*code, 0, "{out}");
        let line = failure_line(out, r);
        assert!(failure_secs(line, r) < 5.0, "{line}");
        assert!(
            line.contains("rank 1 failed")
                && line.contains("ended without reporting an error (killed by a signal"),
            "{line}"
        );
    }
}

#[test]
fn shm_a_failing_rank_stops_its_peers_with_its_reason() {
    check_failing(Backend::Shm, 2);
}

/// Rank 1 of `world_size` fails with an error: every other rank's collective fails with an
/// error naming rank 1 and carrying its reason.
pub(crate) fn check_failing(backend: Backend, world_size: usize) {
    let results = spawn_job_on(backend, world_size, "fail");
    assert!(
        results[1]
            .1
            .contains("rank 1: error: invalid argument: rank 1 gives up")
            || results[1].1.contains("rank 1: error: rank 1 gives up"),
        "{}",
        results[1].1
    );
    for (r, (code, out)) in results.iter().enumerate().filter(|(r, _)| *r != 1) {
        assert_eq!(*code, 0, "{out}");
        let line = failure_line(out, r);
        assert!(failure_secs(line, r) < 5.0, "{line}");
        assert!(
            line.contains("rank 1 failed") && line.contains("rank 1 gives up"),
            "{line}"
        );
    }
}
