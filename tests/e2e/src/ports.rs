//! TCP ports for the components the tests start (etcd, kube-apiserver, kube-scheduler, kubelet).
//!
//! A port picked by binding port 0 comes from the kernel's ephemeral range
//! (`/proc/sys/net/ipv4/ip_local_port_range`, 32768-60999 by default), the same range every
//! outgoing connection takes its local port from. Between picking such a port and the component
//! binding it, any client connection on the machine (a probe, the API server's own etcd client,
//! another test) may take it, and the component exits with "address already in use". CI saw
//! exactly that for kube-apiserver. Ports below the ephemeral range are never handed to outgoing
//! connections, so only another listener can take them; this module never hands out the same
//! port twice in one process and picks at random so that parallel test processes rarely try the
//! same one.

use std::collections::HashSet;
use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::net::{Ipv4Addr, TcpListener};
use std::sync::{Mutex, PoisonError};

/// Lowest port handed out: above the well-known and registered ports the node uses
/// (10248-10259 for the kubelet and control plane defaults).
const LOWEST: u16 = 20000;

/// Ports already handed out by this process.
static HANDED_OUT: Mutex<Option<HashSet<u16>>> = Mutex::new(None);

/// A TCP port that is free on every IPv4 address now, lies below the kernel's ephemeral range
/// (so no outgoing connection can take it before the component binds it) and was not returned
/// before in this process.
///
/// # Errors
///
/// When no port in `20000..` the ephemeral range's start can be bound; when that range is empty
/// (a machine whose ephemeral range starts below 20001) the kernel's pick from binding port 0.
pub fn free_port() -> io::Result<u16> {
    let Some(ephemeral_start) = ephemeral_start().filter(|start| *start > LOWEST + 1) else {
        return TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0))?
            .local_addr()
            .map(|a| a.port());
    };
    let span = u32::from(ephemeral_start - LOWEST);
    let offset = (random() % u64::from(span)) as u32;
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(PoisonError::into_inner);
    let handed_out = handed_out.get_or_insert_with(HashSet::new);
    let mut last_error = None;
    for step in 0..span {
        let port = LOWEST + ((offset + step) % span) as u16;
        if handed_out.contains(&port) {
            continue;
        }
        // Binding the unspecified address conflicts with a listener on any address, so the
        // port is free for a component that binds 127.0.0.1 or 0.0.0.0.
        match TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)) {
            Ok(_) => {
                handed_out.insert(port);
                return Ok(port);
            }
            Err(e) => last_error = Some(e),
        }
    }
    Err(last_error.unwrap_or_else(|| {
        io::Error::new(
            io::ErrorKind::AddrInUse,
            format!("every port in {LOWEST}..{ephemeral_start} was handed out already"),
        )
    }))
}

/// The first port of the kernel's ephemeral range, if it can be read.
fn ephemeral_start() -> Option<u16> {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn random() -> u64 {
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    hasher.finish()
}

/// This machine's first IPv4 address that the API server may proxy to (`IsProxyableIP`,
/// `k8s.io/apimachinery/pkg/util/proxy`: not loopback, link-local or unspecified), for a Pod
/// object whose `status.podIP` must reach a process of the test.
///
/// # Errors
/// When the interfaces cannot be listed or none has such an address.
pub fn proxyable_ipv4() -> io::Result<Ipv4Addr> {
    nix::ifaddrs::getifaddrs()
        .map_err(io::Error::from)?
        .filter_map(|i| Some(i.address?.as_sockaddr_in()?.ip()))
        .find(|ip| !ip.is_loopback() && !ip.is_link_local() && !ip.is_unspecified())
        .ok_or_else(|| io::Error::other("no IPv4 address besides loopback and link-local"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_distinct_free_and_below_the_ephemeral_range() {
        let ports: Vec<u16> = (0..50).map(|_| free_port().unwrap()).collect();
        let distinct: HashSet<u16> = ports.iter().copied().collect();
        assert_eq!(distinct.len(), ports.len(), "{ports:?}");
        if let Some(start) = ephemeral_start().filter(|s| *s > LOWEST + 1) {
            assert!(
                ports.iter().all(|p| (LOWEST..start).contains(p)),
                "{ports:?}"
            );
        }
        for port in ports {
            TcpListener::bind((Ipv4Addr::LOCALHOST, port)).unwrap();
        }
    }
}
