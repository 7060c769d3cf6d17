//! The VXLAN fabric without any agent: two nodes joined by `vxlan0` (MTU
//! 1450), pods with MTU 1450 on hand-made veths; cross-node traffic takes
//! the overlay, a 2 MiB TCP transfer (DF set, as Linux TCP does) between
//! nodes completes, a 1450-byte UDP packet with DF is echoed
//! and a 1451-byte one is refused (EMSGSIZE), and teardown leaves nothing. Needs root.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use npm_e2e::cluster::{own_netns, Cluster, PodWiring};
use npm_e2e::netns::NetnsHandle;
use npm_e2e::nodes::Fabric;

fn out(args: &[&str]) -> (bool, String) {
    let o = Command::new(args[0]).args(&args[1..]).output().expect("run");
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr),
    )
}

#[test]
fn vxlan_fabric_mtu_and_bulk_transfer() {
    let mut c =
        Cluster::with_nodes(2, Fabric::Vxlan, PodWiring::Veth, Path::new("/nonexistent")).expect("two nodes on vxlan");
    let (xa4, xa6) = c.address_of("x", "a").unwrap();
    let (ya4, ya6) = c.address_of("y", "a").unwrap();
    c.create_pod_at("x", "a", xa4, xa6).expect("x/a");
    c.create_pod_at("y", "a", ya4, ya6).expect("y/a");
    let xa = c.pod("x", "a").unwrap();
    let ya = c.pod("y", "a").unwrap();
    assert_eq!(xa.node.as_deref(), Some("node-1"));
    assert_eq!(ya.node.as_deref(), Some("node-2"));
    let (xa_netns, ya_netns) = (xa.netns.clone(), ya.netns.clone());
    let node1 = xa.node_netns.clone().unwrap();
    let (ok, link) = out(&["ip", "-n", &xa_netns, "link", "show", "dev", "eth0"]);
    assert!(ok && link.contains("mtu 1450"), "{link}");
    let (ok, route) = out(&["ip", "-n", &node1, "route", "get", &ya4.to_string()]);
    assert!(ok && route.contains("dev vxlan0"), "{route}");
    let (ok, route) = out(&["ip", "-n", &node1, "-6", "route", "get", &ya6.to_string()]);
    assert!(ok && route.contains("dev vxlan0"), "{route}");

    // 2 MiB from x/a (node 1) to y/a (node 2), IPv4 and IPv6.
    for dst in [SocketAddr::new(ya4.into(), 9000), SocketAddr::new(ya6.into(), 9001)] {
        let server_ns = NetnsHandle::open(&ya_netns).unwrap();
        let bind = SocketAddr::new(
            if dst.is_ipv4() {
                "0.0.0.0".parse().unwrap()
            } else {
                "::".parse().unwrap()
            },
            dst.port(),
        );
        let (tx, rx) = std::sync::mpsc::channel();
        let server = std::thread::spawn(move || {
            server_ns.enter().unwrap();
            let l = TcpListener::bind(bind).unwrap();
            tx.send(()).unwrap();
            let (mut s, _) = l.accept().unwrap();
            let mut total = 0usize;
            let mut buf = vec![0u8; 65536];
            loop {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => total += n,
                }
            }
            total
        });
        rx.recv().unwrap();
        let client_ns = NetnsHandle::open(&xa_netns).unwrap();
        let client = std::thread::spawn(move || {
            client_ns.enter().unwrap();
            let mut s = TcpStream::connect_timeout(&dst, Duration::from_secs(5)).unwrap();
            s.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
            let chunk = vec![0x5au8; 65536];
            for _ in 0..32 {
                s.write_all(&chunk).unwrap();
            }
        });
        client.join().expect("the transfer completes");
        assert_eq!(server.join().unwrap(), 2 << 20, "every byte to {dst}");
    }

    // DF set (IP_PMTUDISC_DO): 1422 bytes of UDP payload + 28 = 1450 are
    // echoed back by y/a's server; 1423 are refused (EMSGSIZE).
    let ns = NetnsHandle::open(&xa_netns).unwrap();
    let dst = SocketAddr::new(ya4.into(), 80);
    let (fits, too_big) = std::thread::spawn(move || {
        ns.enter().unwrap();
        let u = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
        let on: libc::c_int = libc::IP_PMTUDISC_DO;
        // SAFETY: setsockopt on an open socket with an int option.
        let rc = unsafe {
            libc::setsockopt(
                std::os::fd::AsRawFd::as_raw_fd(&u),
                libc::IPPROTO_IP,
                libc::IP_MTU_DISCOVER,
                &on as *const libc::c_int as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        assert_eq!(rc, 0);
        u.connect(dst).unwrap();
        u.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let big = vec![0x42u8; 1422];
        u.send(&big).unwrap();
        let mut buf = vec![0u8; 2048];
        let fits = u.recv(&mut buf).map(|n| n == big.len()).unwrap_or(false);
        let too_big = u.send(&[0x42u8; 1423]).err().and_then(|e| e.raw_os_error());
        (fits, too_big)
    })
    .join()
    .unwrap();
    assert!(fits, "a 1450-byte packet with DF crosses the overlay and comes back");
    assert_eq!(too_big, Some(libc::EMSGSIZE), "a 1451-byte packet with DF is refused");

    c.teardown().expect("teardown");
    assert!(own_netns().is_empty(), "{:?}", own_netns());
}
