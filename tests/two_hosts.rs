//! Two hosts for real (issue 24, item 3): two network namespaces joined by a
//! veth pair, each with its own address and hostname (a UTS namespace per process started
//! there), run the MNIST example
//! - (b) under `mpirun` with a hostfile naming both hosts, an rsh agent that enters the host's
//!   namespace, the TCP transport forced onto the veth subnet: the job ends with the
//!   single-process (thread) run's final accuracy and byte-identical final checkpoint shards,
//!   one rank on each host, and the data crossed the veth;
//!   (feature `mpi`);
//! - (a) under `fsdp-run --nnodes 2 --node-rank K --master-addr HOST0` with `--device cpu`, one
//!   `fsdp-run` in each namespace: the ranks span machines, so the launcher picks the TCP
//!   backend (`comm::tcp`); the job reaches the single-process run's losses, final accuracy and
//!   byte-identical final checkpoint shards, and its data crossed the veth (any build).
//!
//! Needs root and `ip netns` (iproute2), `unshare` (util-linux), and `mpirun` (OpenMPI) for
//! (b); where a namespace cannot be made, each test prints why and returns. The example is the
//! one built next to this binary (`.ci/run` builds it with `--features mpi` before running this
//! test; (a) also runs in a build without features).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// `path` quoted for `sh` (test directories hold parentheses: `ThreadId(2)`).
fn q(path: &Path) -> String {
    format!("'{}'", path.display().to_string().replace('\'', "'\\''"))
}

/// Runs `sh -c script`; its output.
fn sh(script: &str) -> Output {
    Command::new("sh")
        .args(["-c", script])
        .output()
        .expect("sh runs")
}

/// Two namespaces `cf<a|b><tag>` on the subnet `10.231.<net>.0/24`, hosts `host<a|b><tag>`,
/// removed on drop.
struct TwoHosts {
    ns: [String; 2],
    hosts: [String; 2],
    addrs: [String; 2],
    veths: [String; 2],
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    subnet: String,
    dir: PathBuf,
}

impl TwoHosts {
    /// The two hosts, or why they cannot be made here.
    fn new(tag: &str, net: u8) -> Result<TwoHosts, String> {
        // SAFETY: plain syscall.
        if unsafe { libc::geteuid() } != 0 {
            return Err("not root: network namespaces need CAP_SYS_ADMIN".into());
        }
        for tool in ["ip", "unshare"] {
            if sh(&format!("command -v {tool}")).stdout.is_empty() {
                return Err(format!("{tool} is not on PATH"));
            }
        }
        let tag = format!("{tag}{}", std::process::id() % 10_000);
        let t = TwoHosts {
            ns: [format!("cfa{tag}"), format!("cfb{tag}")],
            hosts: [format!("hosta{tag}"), format!("hostb{tag}")],
            addrs: [format!("10.231.{net}.1"), format!("10.231.{net}.2")],
            veths: [format!("va{tag}"), format!("vb{tag}")],
            subnet: format!("10.231.{net}.0/24"),
            dir: common::tmpdir(&format!("two-hosts-{tag}")),
        };
        std::fs::create_dir_all(&t.dir).map_err(|e| e.to_string())?;
        let hosts_file = format!(
            "127.0.0.1 localhost\n{} {}\n{} {}\n",
            t.addrs[0], t.hosts[0], t.addrs[1], t.hosts[1]
        );
        let mut script = format!(
            "set -e; ip link add {va} type veth peer name {vb}; ",
            va = t.veths[0],
            vb = t.veths[1]
        );
        for i in 0..2 {
            let (ns, veth, addr) = (&t.ns[i], &t.veths[i], &t.addrs[i]);
            // `ip netns exec` bind-mounts /etc/netns/<ns>/hosts over /etc/hosts: each host
            // resolves both names to the namespaces' own addresses.
            std::fs::create_dir_all(format!("/etc/netns/{ns}"))
                .and_then(|()| std::fs::write(format!("/etc/netns/{ns}/hosts"), &hosts_file))
                .map_err(|e| format!("/etc/netns/{ns}/hosts: {e}"))?;
            script += &format!(
                "ip netns add {ns}; ip link set {veth} netns {ns}; \
                 ip -n {ns} addr add {addr}/24 dev {veth}; ip -n {ns} link set lo up; \
                 ip -n {ns} link set {veth} up; "
            );
        }
        let out = sh(&script);
        if !out.status.success() {
            return Err(format!(
                "cannot create the namespaces: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        // The rsh agent mpirun starts the remote daemon with: enter the host's namespaces.
        let agent = format!(
            "#!/bin/sh\nhost=$1; shift\ncase $host in\n  {ha}) ns={na};;\n  {hb}) ns={nb};;\n  \
             *) echo \"agent: unknown host $host\" >&2; exit 1;;\nesac\n\
             exec ip netns exec $ns unshare --uts sh -c \"hostname $host; $*\"\n",
            ha = t.hosts[0],
            na = t.ns[0],
            hb = t.hosts[1],
            nb = t.ns[1]
        );
        std::fs::write(t.agent(), agent).map_err(|e| e.to_string())?;
        sh(&format!("chmod +x {}", q(&t.agent())));
        std::fs::write(
            t.dir.join("hostfile"),
            format!("{} slots=1\n{} slots=1\n", t.hosts[0], t.hosts[1]),
        )
        .map_err(|e| e.to_string())?;
        Ok(t)
    }

    fn agent(&self) -> PathBuf {
        self.dir.join("agent.sh")
    }

    /// `script` run on host `i`: in its network namespace and a UTS namespace of its own with
    /// the host's name.
    fn on_host(&self, i: usize, script: &str) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.ns[i], "unshare", "--uts", "sh", "-c"])
            .arg(format!("hostname {} && {script}", self.hosts[i]))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd
    }

    /// Bytes received and sent on host `i`'s end of the veth.
    fn veth_bytes(&self, i: usize) -> (u64, u64) {
        let read = |what: &str| -> u64 {
            let out = sh(&format!(
                "ip netns exec {} cat /sys/class/net/{}/statistics/{what}_bytes",
                self.ns[i], self.veths[i]
            ));
            String::from_utf8_lossy(&out.stdout)
                .trim()
                .parse()
                .unwrap_or(0)
        };
        (read("rx"), read("tx"))
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        for ns in &self.ns {
            let _ = sh(&format!(
                "ip netns del {ns} 2>/dev/null; rm -rf /etc/netns/{ns}"
            ));
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Waits for `child`'s output, killing it after `limit`.
fn output_within(mut child: std::process::Child, limit: Duration) -> (bool, String) {
    let deadline = Instant::now() + limit;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

fn mnist() -> PathBuf {
    crate::common::example_bin(
        "mnist",
        if cfg!(feature = "mpi") {
            "cargo build --release --features mpi --example mnist"
        } else {
            "cargo build --release --example mnist"
        },
    )
}

/// Each epoch's `train loss … test accuracy …%` (after any `[rank r] `).
fn epochs(out: &str) -> Vec<String> {
    out.lines()
        .filter_map(|l| {
            let start = l.find("train loss")?;
            let end = l.find('%')?;
            Some(l[start..=end].to_string())
        })
        .collect()
}

/// The single-process reference (`ws` thread ranks of one process) with checkpoints in `dir`:
/// its output.
fn reference(bin: &Path, dir: &Path, ws: usize) -> String {
    let out = sh(&format!("{} --world-size {ws} {}", q(bin), flags(dir)));
    let ref_out = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{ref_out}");
    ref_out
}

/// The final checkpoint's `ws` shards in `got` are byte for byte those in `want` (the newest
/// `step-*` directory of each, the same step).
fn same_final_shards(want: &Path, got: &Path, ws: usize) {
    let newest = |dir: &Path| {
        let mut steps: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.starts_with("step-"))
            .collect();
        steps.sort();
        steps
            .pop()
            .unwrap_or_else(|| panic!("no checkpoint in {}", dir.display()))
    };
    let last = newest(want);
    assert_eq!(newest(got), last);
    for r in 0..ws {
        let name = format!("shard-{r:05}-of-{ws:05}.safetensors");
        let w = std::fs::read(want.join(&last).join(&name)).unwrap();
        let g = std::fs::read(got.join(&last).join(&name)).unwrap();
        assert!(
            w == g,
            "{last}/{name} differs from the single-process run's"
        );
    }
}

/// Two epochs of 118 steps, a checkpoint at the end of each.
fn flags(dir: &Path) -> String {
    format!(
        "--epochs 2 --batch-size 256 --data-dir {} --checkpoint-dir {}",
        q(&Path::new(env!("CARGO_MANIFEST_DIR")).join("data/mnist")),
        q(dir)
    )
}

#[cfg(feature = "mpi")]
#[test]
fn mpirun_across_two_network_namespaces_reaches_the_single_process_result() {
    if sh("command -v mpirun").stdout.is_empty() {
        println!("SKIPPED: mpirun is not on PATH");
        return;
    }
    let hosts = match TwoHosts::new("m", 11) {
        Ok(h) => h,
        Err(why) => {
            println!("SKIPPED: two hosts cannot be made here: {why}");
            return;
        }
    };
    let bin = mnist();
    let reference = hosts.dir.join("reference");
    let ref_out = crate::reference(&bin, &reference, 2);
    let before = [hosts.veth_bytes(0), hosts.veth_bytes(1)];
    let ckpt = hosts.dir.join("mpi");
    let mpirun = format!(
        "mpirun --allow-run-as-root --hostfile {hostfile} -np 2 --display-map \
         --mca plm_rsh_agent {agent} --mca btl tcp,self --mca btl_tcp_if_include {subnet} \
         --mca oob_tcp_if_include {subnet} {bin} {flags}",
        hostfile = q(&hosts.dir.join("hostfile")),
        agent = q(&hosts.agent()),
        subnet = hosts.subnet,
        bin = q(&bin),
        flags = flags(&ckpt)
    );
    let child = hosts.on_host(0, &mpirun).spawn().unwrap();
    let (ok, out) = output_within(child, Duration::from_secs(300));
    assert!(ok, "{out}");
    assert!(
        !out.contains("built without the `mpi` feature"),
        "the example was built without `--features mpi`:\n{out}"
    );
    // One rank on each host.
    for host in &hosts.hosts {
        assert!(
            out.contains(&format!("Data for node: {host}\tNum slots: 1"))
                && out.contains("world size 2 (mpi on cpu)"),
            "{host}:\n{out}"
        );
    }
    assert_eq!(
        crate::common::final_accuracy(&out),
        crate::common::final_accuracy(&ref_out)
    );
    same_final_shards(&reference, &ckpt, 2);
    // The collectives crossed the veth: every step all-gathers and reduce-scatters the model
    // (110 k parameters, 440 KB in f32), 236 steps: far more than 10 MB each way.
    for (i, (rx0, tx0)) in before.into_iter().enumerate() {
        let (rx, tx) = hosts.veth_bytes(i);
        println!(
            "{}: {} bytes in, {} out",
            hosts.hosts[i],
            rx - rx0,
            tx - tx0
        );
        assert!(
            rx - rx0 > 10 << 20 && tx - tx0 > 10 << 20,
            "{}: {} bytes in, {} out",
            hosts.hosts[i],
            rx - rx0,
            tx - tx0
        );
    }
}

#[test]
fn fsdp_run_on_two_hosts_on_cpu_reaches_the_single_process_result_over_tcp() {
    fsdp_run_on_two_hosts("f", 12, 1);
}

#[test]
fn fsdp_run_on_two_hosts_two_processes_each_reaches_the_single_process_result() {
    fsdp_run_on_two_hosts("g", 13, 2);
}

/// `fsdp-run --nnodes 2 --nproc-per-node <per_node>` of the MNIST example on CPU, one launcher
/// in each namespace (every rank on the TCP backend): rank 0 reports the TCP backend and the
/// reference's losses and accuracy, the final checkpoint is byte for byte the reference's, and
/// the traffic crossed the veth.
fn fsdp_run_on_two_hosts(tag: &str, net: u8, per_node: usize) {
    let hosts = match TwoHosts::new(tag, net) {
        Ok(h) => h,
        Err(why) => {
            println!("SKIPPED: two hosts cannot be made here: {why}");
            return;
        }
    };
    let ws = 2 * per_node;
    let bin = mnist();
    let reference = hosts.dir.join("reference");
    let ref_out = crate::reference(&bin, &reference, ws);
    let before = [hosts.veth_bytes(0), hosts.veth_bytes(1)];
    let ckpt = hosts.dir.join("fsdp-run");
    let fsdp_run = env!("CARGO_BIN_EXE_fsdp-run");
    let children: Vec<_> = (0..2)
        .map(|k| {
            let cmd = format!(
                "{fsdp_run} --nnodes 2 --node-rank {k} --nproc-per-node {per_node} \
                 --master-addr {} --master-port 297{net} -- {} --device cpu {}",
                hosts.hosts[0],
                q(&bin),
                flags(&ckpt)
            );
            hosts.on_host(k, &cmd).spawn().unwrap()
        })
        .collect();
    let outs: Vec<String> = children
        .into_iter()
        .enumerate()
        .map(|(k, child)| {
            let (ok, out) = output_within(child, Duration::from_secs(300));
            assert!(ok, "node {k}:\n{out}");
            out
        })
        .collect();
    let out = &outs[0];
    assert!(
        out.contains(&format!("world size {ws} (tcp on cpu)")),
        "{out}"
    );
    let want = epochs(&ref_out);
    assert_eq!(want.len(), 2, "{ref_out}");
    assert_eq!(epochs(out), want, "{out}");
    assert_eq!(
        crate::common::final_accuracy(out),
        crate::common::final_accuracy(&ref_out)
    );
    same_final_shards(&reference, &ckpt, ws);
    println!(
        "fsdp-run on two hosts, {per_node} process(es) each, over tcp: {want:?}, bitwise the \
         reference's checkpoint"
    );
    // The collectives crossed the veth (as in the mpirun case: far more than 10 MB each way).
    for (i, (rx0, tx0)) in before.into_iter().enumerate() {
        let (rx, tx) = hosts.veth_bytes(i);
        println!(
            "{}: {} bytes in, {} out",
            hosts.hosts[i],
            rx - rx0,
            tx - tx0
        );
        assert!(
            rx - rx0 > 10 << 20 && tx - tx0 > 10 << 20,
            "{}: {} bytes in, {} out",
            hosts.hosts[i],
            rx - rx0,
            tx - tx0
        );
    }
}
