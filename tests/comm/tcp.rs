//! The TCP backend (`comm::tcp`), in real processes on one machine: the jobs of `super::shm`
//! (re-executions of this test binary with torchrun-style variables) with `LOCAL_WORLD_SIZE=1`
//! in every process, which makes `Launcher::from_env` pick the TCP backend as it does for
//! `fsdp-run --nnodes N` (the ranks meet over the loopback interface). Every collective, several
//! dtypes, a sub-group, a mismatch and a long setup argument are bitwise the thread backend's;
//! a rank killed with SIGKILL, failing with an error or leaving the job stops every other rank
//! promptly with an error naming it; an address that cannot be found is named on every rank.

use super::shm::{
    check_exact, check_failing, check_killed, check_too_long, failure_line, failure_secs,
    spawn_job_on, spawn_job_with, Backend,
};

#[test]
fn tcp_collectives_are_bitwise_the_thread_backends() {
    check_exact(Backend::Tcp);
}

#[test]
fn tcp_a_setup_argument_over_the_limit_is_one_error_naming_it() {
    check_too_long(
        Backend::Tcp,
        "new_stream setup argument: expected at most 1048563 bytes (the backend's limit: a \
         descriptor of at most 1048576 bytes), found 1100000 bytes (a descriptor of 1100013 \
         bytes)",
    );
}

#[test]
fn tcp_a_rank_killed_with_sigkill_stops_its_peers_promptly() {
    check_killed(Backend::Tcp, 3);
}

#[test]
fn tcp_a_failing_rank_stops_its_peers_with_its_reason() {
    check_failing(Backend::Tcp, 3);
}

#[test]
fn tcp_an_address_that_cannot_be_found_is_named_on_every_rank() {
    let results = spawn_job_with(Backend::Tcp, 2, "connect", |rank| match rank {
        1 => vec![("FSDP_TCP_IFNAME", "nosuchif0".to_string())],
        _ => Vec::new(),
    });
    let want = "FSDP_TCP_IFNAME=\"nosuchif0\": no such interface with an IP address";
    let (code, out) = &results[1];
    assert_eq!(*code, 0, "{out}");
    assert!(
        out.contains(&format!(
            "rank 1: connect error: invalid argument: tcp backend: {want}"
        )),
        "{out}"
    );
    // Rank 0 learns it through the store instead of waiting for rank 1's address.
    let (code, out) = &results[0];
    assert_eq!(*code, 0, "{out}");
    assert!(
        out.contains("rank 0: connect error:")
            && out.contains("rank 1 failed")
            && out.contains(want),
        "{out}"
    );
}

#[test]
fn tcp_a_rank_that_left_is_named_by_the_others() {
    let results = spawn_job_on(Backend::Tcp, 3, "leave");
    for (r, (code, out)) in results.iter().enumerate() {
        assert_eq!(*code, 0, "rank {r}:\n{out}");
        if r != 1 {
            let line = failure_line(out, r);
            assert!(failure_secs(line, r) < 5.0, "{line}");
            assert!(
                line.contains("rank 1 already exited without joining this collective"),
                "{line}"
            );
        }
    }
}

/// A timeout too large for the clock (`--timeout-s` of years) means no deadline: it panicked
/// adding it to `Instant::now()`.
#[test]
fn tcp_a_timeout_too_large_for_the_clock_is_no_deadline() {
    use candle_fsdp::comm::tcp::{connect, TcpConfig};
    let config = TcpConfig {
        timeout: std::time::Duration::MAX,
    };
    let pg = connect(0, 1, "127.0.0.1", 0, config).unwrap();
    pg.barrier(&pg.default_stream()).wait().unwrap();
}
