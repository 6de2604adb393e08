//! Resident memory and CPU time of this machine's processes, read from `/proc` (what a node of
//! the harness costs; `BENCHMARKS.md` quotes it, no test asserts it).

use std::path::Path;
use std::time::Duration;

/// What a process (or several, summed) holds and has spent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProcessUsage {
    /// Resident memory (`VmRSS` of `/proc/<pid>/status`), in bytes.
    pub rss_bytes: u64,
    /// CPU time in user and kernel mode since the process started (`utime + stime` of
    /// `/proc/<pid>/stat`).
    pub cpu: Duration,
}

impl ProcessUsage {
    /// Process `pid`'s usage now; `None` when it is gone (or `/proc` does not say).
    pub fn of(pid: u32) -> Option<Self> {
        let proc = Path::new("/proc").join(pid.to_string());
        let status = std::fs::read_to_string(proc.join("status")).ok()?;
        let rss_kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))?
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        let stat = std::fs::read_to_string(proc.join("stat")).ok()?;
        // The command name (field 2) is in parentheses and may hold spaces: count fields from
        // the last `)`. utime and stime are fields 14 and 15, so 12 and 13 after the name.
        let mut after_name = stat.rsplit_once(')')?.1.split_whitespace();
        let utime: u64 = after_name.nth(11)?.parse().ok()?;
        let stime: u64 = after_name.next()?.parse().ok()?;
        let ticks = clock_ticks_per_second();
        let ticks_total = utime + stime;
        Some(Self {
            rss_bytes: rss_kib * 1024,
            cpu: Duration::from_secs(ticks_total / ticks)
                + Duration::from_secs_f64((ticks_total % ticks) as f64 / ticks as f64),
        })
    }

    /// The sum over `pids` of those still running.
    pub fn of_all(pids: impl IntoIterator<Item = u32>) -> Self {
        pids.into_iter()
            .filter_map(Self::of)
            .fold(Self::default(), |a, b| a + b)
    }

    /// Resident memory in MiB.
    pub fn rss_mib(&self) -> f64 {
        self.rss_bytes as f64 / (1024.0 * 1024.0)
    }
}

impl std::ops::Add for ProcessUsage {
    type Output = Self;
    fn add(self, other: Self) -> Self {
        Self {
            rss_bytes: self.rss_bytes + other.rss_bytes,
            cpu: self.cpu + other.cpu,
        }
    }
}

/// `sysconf(_SC_CLK_TCK)`, the unit of `/proc/<pid>/stat`'s times (100 on Linux, whatever the
/// kernel's own tick rate).
fn clock_ticks_per_second() -> u64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .and_then(|t| u64::try_from(t).ok())
        .filter(|t| *t > 0)
        .unwrap_or(100)
}

/// The processes whose command name (`/proc/<pid>/comm`, at most 15 bytes) starts with `comm`
/// and whose command line mentions `needle` (a node's root directory, say).
pub fn pids_named(comm: &str, needle: &str) -> Vec<u32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let name = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
        if !name.starts_with(comm) {
            continue;
        }
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains(needle) {
            pids.push(pid);
        }
    }
    pids
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_holds_memory_and_has_spent_cpu() {
        let mut spin = 0u64;
        for i in 0..5_000_000u64 {
            spin = spin.wrapping_add(i * i);
        }
        assert_ne!(spin, 1);
        let me = ProcessUsage::of(std::process::id()).expect("this process in /proc");
        assert!(me.rss_bytes > 0, "{me:?}");
        assert!(me.cpu > Duration::ZERO, "{me:?}");
        // A PID the kernel never hands out (above pid_max's limit of 2^22) counts as gone.
        let both = ProcessUsage::of_all([std::process::id(), u32::MAX]);
        assert!(both.rss_bytes > 0 && both.cpu >= me.cpu, "{both:?} {me:?}");
        assert_eq!(ProcessUsage::of(u32::MAX), None);
    }
}
