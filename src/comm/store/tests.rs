//! The store's own tests: the wire format's refusals, key checks, formatting (the round trip of
//! every message: tests/comm/store.rs).

use super::wire::*;
use super::*;

#[test]
fn malformed_messages_are_refused() {
    let refusal = |body: &[u8]| Request::decode(body).unwrap_err();
    // `Hello` (index 0) cut inside its magic.
    assert!(refusal(&[0, b'X']).contains("truncated"));
    let mut hello = encode(&Request::Hello {
        magic: *MAGIC,
        rank: 0,
        world_size: 1,
        job: String::new(),
    });
    hello[1] = b'Z';
    assert!(refusal(&hello).contains("bad magic"));
    // A `Get` (index 2) whose key announces 4 GiB (a varint), and one over the key bound.
    assert!(refusal(&[2, 0xff, 0xff, 0xff, 0xff, 0x0f]).contains("truncated"));
    let long = encode(&Request::Get {
        key: "k".repeat(2000),
        wait_ms: 0,
    });
    assert!(refusal(&long).contains("key of 2000 bytes exceeds the limit of 1024 bytes"));
    assert!(refusal(&[0x42]).contains("unknown request opcode 0x42"));
    assert!(
        refusal(&[1, 1, 0xff, 0]).contains("utf-8"),
        "a key that is not UTF-8"
    );
    let mut extra = encode(&Request::Joined { wait_ms: 1 });
    extra.push(0);
    assert!(refusal(&extra).contains("1 unexpected trailing bytes"));
    let pending = Reply::Pending {
        missing: vec![],
        left: vec![],
        notes: "n".repeat(MAX_NOTES_BYTES + 1),
    };
    let err = Reply::decode(&encode(&pending)).unwrap_err();
    assert!(
        err.contains("notes of 32785 bytes exceeds the limit"),
        "{err}"
    );
    // Peers of other builds are named as such: a protocol V2 client's HELLO (opcode 1, the
    // magic), and a V2 server's error reply (0xFF, a 4-byte length, the text).
    let mut v2_hello = vec![1];
    v2_hello.extend_from_slice(b"CFSDPKV2");
    v2_hello.extend_from_slice(&[0; 12]);
    let err = refusal(&v2_hello);
    assert!(
        err.contains("store protocol CFSDPKV2, this server CFSDPKV4"),
        "{err}"
    );
    let mut v2_err = vec![0xFF, 0, 0, 0, 2];
    v2_err.extend_from_slice(b"no");
    let err = Reply::decode(&v2_err).unwrap_err();
    assert!(
        err.contains("older protocol than this client (CFSDPKV4)") && err.contains("said: no"),
        "{err}"
    );
    // A zero frame length (a longer one: tests/comm/store.rs).
    let mut zero = &0u32.to_be_bytes()[..];
    let err = read_frame(&mut zero).unwrap_err();
    assert!(
        err.to_string().contains("frame of 0 bytes refused"),
        "{err}"
    );
}

#[test]
fn ipv6_addresses_print_in_brackets() {
    assert_eq!(display_addr("::1", 29500), "[::1]:29500");
}

#[test]
fn a_rank_of_another_job_on_the_port_is_refused_and_the_job_goes_on() {
    // Job "a" (2 ranks) serves the store; a rank 1 of job "b" (started on the same port) comes
    // first and is refused, naming both jobs; job "a"'s own rank 1 then joins, and both of
    // job "a"'s ranks finish joining (before: the intruder took rank 1, the real one was
    // refused as "joined twice", and job "a" failed).
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let t = Duration::from_secs(20);
    let r0 = std::thread::spawn(move || TcpStore::connect_as("127.0.0.1", port, 0, 2, t, "a"));
    let Err(intruder) = TcpStore::connect_as("127.0.0.1", port, 1, 2, t, "b") else {
        panic!("a rank of another job joined");
    };
    let intruder = intruder.to_string();
    assert!(
        intruder.contains("belongs to job \"b\"")
            && intruder.contains("serves job \"a\"")
            && intruder.contains("MASTER_PORT"),
        "{intruder}"
    );
    let r1 = TcpStore::connect_as("127.0.0.1", port, 1, 2, t, "a").unwrap();
    let r0 = r0.join().unwrap().unwrap();
    r1.set("k", b"v").unwrap();
    assert_eq!(r0.get("k").unwrap(), b"v");
}

#[test]
fn rank_0_names_a_master_address_that_does_not_resolve() {
    // Before: "could not connect … is rank 0 running?", blaming the rank that serves the store.
    // The name is retried until the timeout (a DNS record may appear once the job is up).
    let t = Duration::from_millis(1500);
    let Err(e) = TcpStore::connect_as("no-such-host.invalid", 29999, 0, 2, t, "a") else {
        panic!("a store served at a name that does not resolve");
    };
    let msg = e.to_string();
    assert!(
        msg.contains("rank 0 serves the store at no-such-host.invalid:29999, but the name did not resolve on this machine within 1.5 s: \"no-such-host.invalid\" does not resolve"),
        "{msg}"
    );
}

#[test]
fn a_bracketed_ipv6_master_address_is_served() {
    // `[::1]` (as a URL writes it) was looked up with its brackets and never resolved.
    let Ok(l) = std::net::TcpListener::bind("[::1]:0") else {
        eprintln!("no IPv6 loopback on this machine: not checked");
        return;
    };
    let port = l.local_addr().unwrap().port();
    drop(l);
    let store = TcpStore::connect_as("[::1]", port, 0, 1, Duration::from_secs(10), "a");
    assert!(store.is_ok(), "{:?}", store.err());
}
