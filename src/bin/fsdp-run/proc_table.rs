//! The process table, read from `/proc` (Linux; empty elsewhere).

/// One live (not zombie) process.
#[derive(Debug, Clone, Copy)]
pub struct Info {
    pub pid: i32,
    pub ppid: i32,
    pub pgid: i32,
}

/// Parses `/proc/<pid>/stat`: `pid (comm) state ppid pgrp …`; `None` for a zombie or a
/// process gone meanwhile.
fn read(pid: i32) -> Option<Info> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: the fields follow the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut f = rest.split_whitespace();
    let state = f.next()?;
    if state == "Z" || state == "X" {
        return None;
    }
    Some(Info {
        pid,
        ppid: f.next()?.parse().ok()?,
        pgid: f.next()?.parse().ok()?,
    })
}

/// Every live process of the machine.
pub fn all() -> Vec<Info> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(read)
        .collect()
}

/// The live descendants of `root`, leaving out `skip` and its own descendants.
pub fn descendants(root: i32, skip: Option<i32>) -> Vec<Info> {
    let all = all();
    let mut found: Vec<Info> = Vec::new();
    let mut parents = vec![root];
    while let Some(parent) = parents.pop() {
        for p in all
            .iter()
            .filter(|p| p.ppid == parent && Some(p.pid) != skip)
        {
            found.push(*p);
            parents.push(p.pid);
        }
    }
    found
}

/// Whether process `pid`'s environment holds `entry` (`NAME=value`).
pub fn has_env(pid: i32, entry: &[u8]) -> bool {
    std::fs::read(format!("/proc/{pid}/environ"))
        .map(|env| env.split(|&b| b == 0).any(|e| e == entry))
        .unwrap_or(false)
}

/// Sends `sig` to the process groups of `procs` that are the job's (`is_job_group`),
/// once each and whether or not their leader is alive (a group lives as long as a
/// member does, so its id cannot have been reused), and to the other processes one by
/// one. Returns how many processes were signalled.
pub fn signal(procs: &[Info], is_job_group: impl Fn(i32) -> bool, sig: i32) -> usize {
    let mut groups = std::collections::BTreeSet::new();
    for p in procs {
        if is_job_group(p.pgid) || procs.iter().any(|q| q.pid == p.pgid) {
            if groups.insert(p.pgid) {
                // SAFETY: plain syscall; the group has a live member (p).
                unsafe {
                    libc::kill(-p.pgid, sig);
                }
            }
        } else {
            // SAFETY: plain syscall on a live process.
            unsafe {
                libc::kill(p.pid, sig);
            }
        }
    }
    procs.len()
}
