//! The TCP backend (`comm::tcp`), in real processes on one machine: the jobs of `super::shm`
//! (re-executions of this test binary with torchrun-style variables) with `LOCAL_WORLD_SIZE=1`
//! in every process, which makes `Launcher::from_env` pick the TCP backend as it does for
//! `fsdp-run --nnodes N` (the ranks meet over the loopback interface). Every collective, several
//! dtypes, a sub-group, a mismatch and a long setup argument are bitwise the thread backend's;
//! a rank killed with SIGKILL or failing with an error stops every other rank promptly with an
//! error naming it.

use super::shm::{check_exact, check_failing, check_killed, Backend};

#[test]
fn tcp_collectives_are_bitwise_the_thread_backends() {
    check_exact(Backend::Tcp);
}

#[test]
fn tcp_a_rank_killed_with_sigkill_stops_its_peers_promptly() {
    check_killed(Backend::Tcp, 3);
}

#[test]
fn tcp_a_failing_rank_stops_its_peers_with_its_reason() {
    check_failing(Backend::Tcp, 3);
}
