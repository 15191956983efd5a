//! The TCP key-value store that bootstraps torchrun-style jobs (`comm::store`): ranks as
//! threads of this process and as processes (this test binary re-executed, one `#[ignore]`d
//! helper per rank), set/get across ranks, `get` blocking until a `set`, barriers, and every
//! failure naming what is missing: ranks that never join, a key never set, ranks that never
//! reach a barrier or left, a port already in use, a wrong world size, a duplicate rank, a
//! server gone, malformed and oversized frames.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use candle_fsdp::comm::store::{TcpStore, MAX_VALUE_BYTES};
use candle_fsdp::Error;

const T: Duration = Duration::from_secs(20);

/// A port nothing listens on now (bound then released).
use crate::common::free_port;

/// Connects `world_size` ranks as threads; runs `f` on each; returns the results by rank.
fn ranks<R: Send>(
    world_size: usize,
    timeout: Duration,
    f: impl Fn(TcpStore) -> R + Sync,
) -> Vec<R> {
    let port = free_port();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world_size)
            .map(|r| {
                let f = &f;
                s.spawn(move || {
                    f(TcpStore::connect("127.0.0.1", port, r, world_size, timeout).unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn store_error(e: Error) -> (usize, Vec<usize>, String) {
    let text = e.to_string();
    match e {
        Error::Store { rank, missing, .. } => (rank, missing, text),
        other => panic!("expected Error::Store, got {other:?}"),
    }
}

#[test]
fn set_and_get_across_thread_ranks() {
    let got = ranks(4, T, |store| {
        assert_eq!(store.world_size(), 4);
        let r = store.rank();
        if r == 0 {
            store
                .set("nccl_id", &(0..128).collect::<Vec<u8>>())
                .unwrap();
        }
        store.set(&format!("rank{r}"), &[r as u8; 3]).unwrap();
        let id = store.get("nccl_id").unwrap();
        store.barrier("written").unwrap();
        let others: Vec<Vec<u8>> = (0..4)
            .map(|o| store.get(&format!("rank{o}")).unwrap())
            .collect();
        (r, id, others)
    });
    for (r, (rank, id, others)) in got.into_iter().enumerate() {
        assert_eq!(rank, r);
        assert_eq!(id, (0..128).collect::<Vec<u8>>());
        for (o, v) in others.iter().enumerate() {
            assert_eq!(v, &vec![o as u8; 3]);
        }
    }
}

#[test]
fn world_of_one_and_values_at_the_bounds() {
    let port = free_port();
    let store = TcpStore::connect("localhost", port, 0, 1, T).unwrap();
    store.set("empty", &[]).unwrap();
    assert_eq!(store.get("empty").unwrap(), Vec::<u8>::new());
    let big = vec![7u8; MAX_VALUE_BYTES];
    store.set("big", &big).unwrap();
    assert_eq!(store.get("big").unwrap(), big);
    store.set("k", b"first").unwrap();
    store.set("k", b"second").unwrap();
    assert_eq!(store.get("k").unwrap(), b"second");
    store.barrier("alone").unwrap();
    let err = store
        .set("too_big", &vec![0u8; MAX_VALUE_BYTES + 1])
        .unwrap_err();
    assert!(
        matches!(err, Error::Value { .. })
            && err.to_string().contains(&format!(
                "must be at most {MAX_VALUE_BYTES} bytes, found {} bytes",
                MAX_VALUE_BYTES + 1
            )),
        "{err}"
    );
    let err = store.get(&"k".repeat(2000)).unwrap_err();
    assert!(
        err.to_string()
            .contains("store: key must be at most 1024 bytes, found 2000 bytes"),
        "{err}"
    );
    // Still usable after refused arguments.
    assert_eq!(store.get("k").unwrap(), b"second");
}

#[test]
fn get_blocks_until_another_rank_sets() {
    let got = ranks(2, T, |store| {
        if store.rank() == 0 {
            std::thread::sleep(Duration::from_millis(600));
            store.set("late", b"value").unwrap();
            (Duration::ZERO, vec![])
        } else {
            let start = Instant::now();
            let v = store.get("late").unwrap();
            (start.elapsed(), v)
        }
    });
    let (waited, v) = &got[1];
    assert_eq!(v, b"value");
    assert!(*waited >= Duration::from_millis(400), "{waited:?}");
    assert!(*waited < Duration::from_secs(5), "{waited:?}");
}

#[test]
fn barrier_releases_every_rank_after_the_last_arrives_and_can_be_reused() {
    let start = Instant::now();
    let got = ranks(3, T, |store| {
        let r = store.rank() as u64;
        let mut left = vec![];
        for round in 0..3u64 {
            // Rank 2 arrives last, 300 ms after the others, each round.
            std::thread::sleep(Duration::from_millis(150 * r));
            store.barrier("step").unwrap();
            left.push((round, Instant::now()));
        }
        left
    });
    // Round k: nobody leaves before rank 2 arrived (k+1) * 300 ms after the start.
    for (r, left) in got.iter().enumerate() {
        for (round, at) in left {
            let floor = Duration::from_millis(300 * (round + 1));
            assert!(
                at.duration_since(start) >= floor - Duration::from_millis(50),
                "rank {r} left barrier round {round} at {:?}",
                at.duration_since(start)
            );
        }
    }
}

/// One rank's threads share its store: a thread waiting in `get` (a failure-notice watcher,
/// say) does not hold up another thread's `set`s for longer than one polling round.
#[test]
fn a_waiting_get_does_not_hold_up_a_set_of_another_thread() {
    let got = ranks(2, T, |store| {
        if store.rank() == 1 {
            std::thread::scope(|s| {
                let watcher = s.spawn(|| store.get("inbox1").unwrap());
                std::thread::sleep(Duration::from_millis(100));
                let mut slowest = Duration::ZERO;
                for i in 0..10 {
                    let t0 = Instant::now();
                    store.set(&format!("x{i}"), b"v").unwrap();
                    slowest = slowest.max(t0.elapsed());
                }
                store.set("sets_done", b"").unwrap();
                (slowest, watcher.join().unwrap())
            })
        } else {
            store.get("sets_done").unwrap();
            for i in 0..10 {
                store.get(&format!("x{i}")).unwrap();
            }
            store.set("inbox1", b"notice").unwrap();
            (Duration::ZERO, vec![])
        }
    });
    let (slowest, notice) = &got[1];
    assert_eq!(notice, b"notice");
    assert!(
        *slowest < Duration::from_millis(400),
        "a set waited {slowest:?}"
    );
}

#[test]
fn server_may_start_after_the_clients() {
    let port = free_port();
    let clients: Vec<_> = (1..3)
        .map(|r| {
            std::thread::spawn(move || {
                let s = TcpStore::connect("127.0.0.1", port, r, 3, T).unwrap();
                s.get("from0").unwrap()
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(800));
    let s0 = TcpStore::connect("127.0.0.1", port, 0, 3, T).unwrap();
    s0.set("from0", b"hi").unwrap();
    for c in clients {
        assert_eq!(c.join().unwrap(), b"hi");
    }
}

#[test]
fn ranks_that_never_join_are_named() {
    let port = free_port();
    let t = Duration::from_secs(1);
    let r1 = std::thread::spawn(move || TcpStore::connect("127.0.0.1", port, 1, 4, t));
    let start = Instant::now();
    let (rank, missing, text) =
        store_error(TcpStore::connect("127.0.0.1", port, 0, 4, t).unwrap_err());
    assert!(start.elapsed() < Duration::from_secs(4));
    assert_eq!((rank, missing), (0, vec![2, 3]));
    assert_eq!(
        text,
        format!("rank 0: ranks [2, 3] of 4 did not join the store at 127.0.0.1:{port} within 1 s")
    );
    let (_, missing, _) = store_error(r1.join().unwrap().unwrap_err());
    assert_eq!(missing, vec![2, 3]);
}

#[test]
fn no_server_is_an_error_naming_the_address() {
    let port = free_port();
    let start = Instant::now();
    let err = TcpStore::connect("127.0.0.1", port, 1, 2, Duration::from_millis(700)).unwrap_err();
    let elapsed = start.elapsed();
    assert!(elapsed >= Duration::from_millis(600) && elapsed < Duration::from_secs(3));
    let (_, _, text) = store_error(err);
    assert!(
        text.starts_with(&format!(
            "rank 1: could not connect to the store at 127.0.0.1:{port} within 0.7 s: "
        )) && text.contains("refused")
            && text.contains("rank 0 serves it"),
        "{text}"
    );
}

#[test]
fn a_key_never_set_is_named() {
    let got = ranks(2, Duration::from_millis(1500), |store| {
        if store.rank() == 1 {
            let start = Instant::now();
            let e = store.get("nccl_id").unwrap_err();
            Some((start.elapsed(), store_error(e), store.get("other").is_err()))
        } else {
            std::thread::sleep(Duration::from_secs(3));
            None
        }
    });
    let (waited, (_, _, text), _) = got[1].clone().unwrap();
    assert!(
        waited >= Duration::from_millis(1450) && waited < Duration::from_secs(3),
        "{waited:?}"
    );
    assert!(
        text.starts_with("rank 1: key \"nccl_id\" was not set in the store at 127.0.0.1:")
            && text.ends_with(" within 1.5 s"),
        "{text}"
    );
}

#[test]
fn ranks_that_miss_a_barrier_are_named() {
    let got = ranks(3, Duration::from_millis(1500), |store| {
        if store.rank() == 2 {
            std::thread::sleep(Duration::from_secs(2));
            None
        } else {
            Some(store_error(store.barrier("init").unwrap_err()))
        }
    });
    for (r, got) in got.iter().take(2).enumerate() {
        let (rank, missing, text) = got.clone().unwrap();
        assert_eq!((rank, missing), (r, vec![2]));
        assert!(
            text.starts_with(&format!(
                "rank {r}: ranks [2] of 3 did not arrive at barrier \"init\" of the store at \
                 127.0.0.1:"
            )) && text.ends_with("within 1.5 s"),
            "{text}"
        );
    }
}

#[test]
fn a_rank_that_drops_its_store_fails_the_barrier_at_once() {
    let start = Instant::now();
    let got = ranks(3, T, |store| {
        if store.rank() == 1 {
            drop(store);
            None
        } else {
            Some(store_error(store.barrier("end").unwrap_err()))
        }
    });
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    let (_, missing, text) = got[0].clone().unwrap();
    assert_eq!(missing, vec![1]);
    assert!(
        text.contains("ranks [1] of 3 left the store at 127.0.0.1:")
            && text.contains("before arriving at barrier \"end\""),
        "{text}"
    );
}

#[test]
fn rank_zero_may_drop_its_store_after_set() {
    let port = free_port();
    let sync = Barrier::new(2);
    std::thread::scope(|s| {
        let reader = s.spawn(|| {
            let store = TcpStore::connect("127.0.0.1", port, 1, 2, T).unwrap();
            sync.wait();
            // Rank 0 has dropped its store by now.
            std::thread::sleep(Duration::from_millis(300));
            store.get("id").unwrap()
        });
        let store = TcpStore::connect("127.0.0.1", port, 0, 2, T).unwrap();
        store.set("id", b"abc").unwrap();
        drop(store);
        sync.wait();
        assert_eq!(reader.join().unwrap(), b"abc");
    });
    // The port is free again once rank 0's store and its clients are gone.
    std::thread::sleep(Duration::from_millis(100));
    let again = TcpStore::connect("127.0.0.1", port, 0, 1, T).unwrap();
    again.barrier("x").unwrap();
}

#[test]
fn a_port_in_use_is_named_with_the_os_error() {
    let holder = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = holder.local_addr().unwrap().port();
    let (rank, _, text) = store_error(TcpStore::connect("127.0.0.1", port, 0, 2, T).unwrap_err());
    assert_eq!(rank, 0);
    assert!(
        text.starts_with(&format!(
            "rank 0: cannot serve the store at 127.0.0.1:{port}: binding 0.0.0.0:{port} failed: "
        )) && text.contains("in use")
            && text.contains("choose another MASTER_PORT"),
        "{text}"
    );
}

#[test]
fn wrong_world_size_and_duplicate_rank_are_refused() {
    let port = free_port();
    let t = Duration::from_secs(2);
    std::thread::scope(|s| {
        let r0 = s.spawn(|| TcpStore::connect("127.0.0.1", port, 0, 3, t));
        let r1 = s.spawn(|| TcpStore::connect("127.0.0.1", port, 1, 3, t));
        std::thread::sleep(Duration::from_millis(300));
        let (_, _, text) = store_error(TcpStore::connect("127.0.0.1", port, 2, 4, t).unwrap_err());
        assert!(
            text.contains("refused joining: rank 2 (from 127.0.0.1:")
                && text.contains(
                    "asked to join with world size 4, but the store (served by rank 0) has world \
                 size 3"
                ),
            "{text}"
        );
        // Rank 1 again, while the first rank 1 is connected.
        std::thread::sleep(Duration::from_millis(300));
        let (_, _, text) = store_error(TcpStore::connect("127.0.0.1", port, 1, 3, t).unwrap_err());
        assert!(
            text.contains("rank 1 joined twice: from 127.0.0.1:")
                && text.contains(" and again from 127.0.0.1:"),
            "{text}"
        );
        // Rank 0 times out naming rank 2 and what the store refused.
        let (_, missing, text) = store_error(r0.join().unwrap().unwrap_err());
        assert_eq!(missing, vec![2]);
        assert!(
            text.contains("ranks [2] of 3 did not join the store")
                && text.contains("the store refused: rank 2 (from")
                && text.contains("rank 1 joined twice"),
            "{text}"
        );
        assert!(r1.join().unwrap().is_err());
    });
}

#[test]
fn bad_arguments_are_refused() {
    for (rank, ws, port, expected) in [
        (2, 2, 1234, "rank 2 is out of range for world size 2"),
        (
            0,
            0,
            1234,
            "world size must be at least 1 (a job needs at least one rank), found 0",
        ),
        (
            0,
            1,
            0,
            "port must be a fixed port that every rank knows (MASTER_PORT), found 0",
        ),
    ] {
        let err = TcpStore::connect("127.0.0.1", port, rank, ws, T).unwrap_err();
        assert!(
            err.is_argument() && err.to_string().contains(expected),
            "{err}"
        );
    }
}

/// Raw TCP to the store: a client announcing a 4 GiB frame, or speaking another protocol, is
/// refused and disconnected; the store goes on serving the ranks.
#[test]
fn oversized_and_foreign_frames_are_refused() {
    let port = free_port();
    let store = TcpStore::connect("127.0.0.1", port, 0, 1, T).unwrap();
    let reply_to = |bytes: &[u8]| -> String {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(bytes).unwrap();
        let mut out = vec![];
        s.read_to_end(&mut out).unwrap(); // the server closes after its error reply
        String::from_utf8_lossy(&out).into_owned()
    };
    let text = reply_to(&u32::MAX.to_be_bytes());
    assert!(text.contains("frame of 4294967295 bytes refused"), "{text}");
    let text = reply_to(b"GET / HTTP/1.1\r\n\r\n");
    assert!(text.contains("frame of"), "{text}");
    // A well-formed frame that is not HELLO first (`Joined`, index 3, wait 1 ms).
    let text = reply_to(&[0, 0, 0, 2, 3, 1]);
    assert!(
        text.contains("first request of a connection must be HELLO"),
        "{text}"
    );
    store.set("still", b"ok").unwrap();
    assert_eq!(store.get("still").unwrap(), b"ok");
}

/// A key that looks like the start of an older client's HELLO (67 bytes, `FSDPKV` and a
/// version byte: its length byte reads as `C`) is a key: it was refused as an old client.
#[test]
fn a_key_like_an_old_clients_hello_is_a_key() {
    let store = TcpStore::connect("127.0.0.1", free_port(), 0, 1, T).unwrap();
    let key = format!("FSDPKV2{}", "k".repeat(60));
    assert_eq!(key.len(), 67);
    store.set(&key, b"v").unwrap();
    assert_eq!(store.get(&key).unwrap(), b"v");
}

/// A timeout too large for the clock (`--timeout-s` of years) means no deadline: it panicked
/// adding it to `Instant::now()`.
#[test]
fn a_timeout_too_large_for_the_clock_is_no_deadline() {
    let store = TcpStore::connect("127.0.0.1", free_port(), 0, 1, Duration::MAX).unwrap();
    store.set("k", b"v").unwrap();
    assert_eq!(store.get("k").unwrap(), b"v");
    store.barrier("b").unwrap();
}

/// A server that is not a store: the client says so instead of waiting or allocating.
#[test]
fn a_foreign_server_is_named() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
        std::thread::sleep(Duration::from_millis(500));
    });
    let (_, _, text) = store_error(TcpStore::connect("127.0.0.1", port, 1, 2, T).unwrap_err());
    assert!(
        text.contains(&format!(
            "the server at 127.0.0.1:{port} is not a candle-fsdp store"
        )),
        "{text}"
    );
    server.join().unwrap();
}

// ---------------------------------------------------------------------------------------------
// Ranks as processes
// ---------------------------------------------------------------------------------------------

/// Starts this test binary's `helper` as rank `rank` of `world_size`, talking to the store at
/// `port`.
fn spawn_rank(
    helper: &str,
    rank: usize,
    world_size: usize,
    port: u16,
    mode: &str,
) -> std::process::Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            &crate::common::test_path(module_path!(), helper),
            "--nocapture",
            "--test-threads=1",
        ])
        .env("STORE_TEST_RANK", rank.to_string())
        .env("STORE_TEST_WORLD_SIZE", world_size.to_string())
        .env("STORE_TEST_PORT", port.to_string())
        .env("STORE_TEST_MODE", mode)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits for every child (at most 60 s in all); returns (exit code, stdout + stderr) of each.
pub(crate) fn wait_all(children: Vec<std::process::Child>) -> Vec<(i32, String)> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut children: Vec<Option<std::process::Child>> = children.into_iter().map(Some).collect();
    let mut done: Vec<Option<(i32, String)>> = vec![None; children.len()];
    while done.iter().any(Option::is_none) {
        for (i, c) in children.iter_mut().enumerate() {
            if let Some(child) = c {
                if child.try_wait().unwrap().is_some() {
                    let out = c.take().unwrap().wait_with_output().unwrap();
                    done[i] = Some((
                        out.status.code().unwrap_or(-1),
                        format!(
                            "{}{}",
                            String::from_utf8_lossy(&out.stdout),
                            String::from_utf8_lossy(&out.stderr)
                        ),
                    ));
                }
            }
        }
        if Instant::now() > deadline {
            for c in children.iter_mut().flatten() {
                let _ = c.kill();
            }
            panic!("store processes still running after 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    done.into_iter().map(Option::unwrap).collect()
}

fn env_usize(v: &str) -> usize {
    std::env::var(v).unwrap().parse().unwrap()
}

#[test]
#[ignore = "a rank process of processes_exchange_an_id_and_meet_at_barriers"]
fn helper_store_rank() {
    let rank = env_usize("STORE_TEST_RANK");
    let world_size = env_usize("STORE_TEST_WORLD_SIZE");
    let port = env_usize("STORE_TEST_PORT") as u16;
    let mode = std::env::var("STORE_TEST_MODE").unwrap();
    let timeout = Duration::from_secs(if mode == "ok" { 30 } else { 10 });
    let store = match TcpStore::connect("127.0.0.1", port, rank, world_size, timeout) {
        Ok(s) => s,
        Err(e) => {
            crate::common::report_rank_error(rank, &e);
            std::process::exit(1);
        }
    };
    let result = (|| -> candle_fsdp::Result<()> {
        match mode.as_str() {
            "ok" => {
                if rank == 0 {
                    store.set("nccl_id", &(0..128u8).rev().collect::<Vec<u8>>())?;
                }
                let id = store.get("nccl_id")?;
                assert_eq!(id, (0..128u8).rev().collect::<Vec<u8>>());
                store.set(
                    &format!("pid{rank}"),
                    std::process::id().to_string().as_bytes(),
                )?;
                store.barrier("pids")?;
                let pids: Vec<String> = (0..world_size)
                    .map(|r| Ok(String::from_utf8(store.get(&format!("pid{r}"))?).unwrap()))
                    .collect::<candle_fsdp::Result<_>>()?;
                store.barrier("done")?;
                println!(
                    "rank {rank} ok: id of {} bytes, pids {}",
                    id.len(),
                    pids.join(",")
                );
                Ok(())
            }
            // The last rank's process dies without warning once every rank has joined.
            "rank-dies" if rank == world_size - 1 => {
                std::thread::sleep(Duration::from_millis(200));
                std::process::exit(3);
            }
            "rank-dies" => store.barrier("never"),
            // Rank 0 (the server) dies while the others wait for a key.
            "server-dies" if rank == 0 => {
                std::thread::sleep(Duration::from_millis(300));
                std::process::exit(3);
            }
            "server-dies" => store.get("never").map(|_| ()),
            other => panic!("unknown mode {other}"),
        }
    })();
    if let Err(e) = result {
        crate::common::report_rank_error(rank, &e);
        if rank == 0 {
            // Rank 0's exit ends the store: give the others the time to read their own reply
            // (else they may report the lost connection instead).
            std::thread::sleep(Duration::from_millis(1000));
        }
        std::process::exit(1);
    }
}

#[test]
fn processes_exchange_an_id_and_meet_at_barriers() {
    let port = free_port();
    // Ranks 1 and 2 first; rank 0, which serves the store, half a second later.
    let mut children: Vec<_> = (1..3)
        .map(|r| spawn_rank("helper_store_rank", r, 3, port, "ok"))
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    children.insert(0, spawn_rank("helper_store_rank", 0, 3, port, "ok"));
    let pids: Vec<u32> = children.iter().map(|c| c.id()).collect();
    let expected_pids = pids
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",");
    for (r, (code, out)) in wait_all(children).into_iter().enumerate() {
        assert_eq!(code, 0, "rank {r}:\n{out}");
        assert!(
            out.contains(&format!(
                "rank {r} ok: id of 128 bytes, pids {expected_pids}"
            )),
            "rank {r}:\n{out}"
        );
    }
}

#[test]
fn a_rank_process_that_dies_fails_the_others_barrier_at_once() {
    let port = free_port();
    let start = Instant::now();
    let children: Vec<_> = (0..3)
        .map(|r| spawn_rank("helper_store_rank", r, 3, port, "rank-dies"))
        .collect();
    let results = wait_all(children);
    assert!(
        start.elapsed() < Duration::from_secs(8),
        "{:?}",
        start.elapsed()
    );
    assert_ne!(results[2].0, 0);
    for (r, (code, out)) in results.iter().take(2).enumerate() {
        assert_eq!(*code, 1, "{out}");
        assert!(
            out.contains(&format!(
                "rank {r}: error: rank {r}: ranks [2] of 3 left the store at 127.0.0.1:{port} \
                 (their process exited or dropped its store) before arriving at barrier \
                 \"never\""
            )),
            "rank {r}:\n{out}"
        );
    }
}

#[test]
fn the_server_process_dying_fails_the_others_at_once() {
    let port = free_port();
    let start = Instant::now();
    let children: Vec<_> = (0..3)
        .map(|r| spawn_rank("helper_store_rank", r, 3, port, "server-dies"))
        .collect();
    let results = wait_all(children);
    assert!(
        start.elapsed() < Duration::from_secs(8),
        "{:?}",
        start.elapsed()
    );
    for (r, (code, out)) in results.iter().enumerate().skip(1) {
        assert_eq!(*code, 1, "{out}");
        assert!(
            out.contains(&format!(
                "rank {r}: error: rank {r}: lost the connection to the store at \
                 127.0.0.1:{port} during get of key \"never\""
            )) && out.contains("rank 0, which serves the store, exited or dropped it"),
            "rank {r}:\n{out}"
        );
    }
}
