//! Enforcement survives the loader, in each attach mode: a loader process
//! programs and pins maps, attaches (tcx links pinned, or tc filters) and
//! exits; traffic is still enforced with no loader running; a new loader
//! adopts the pinned maps and the links or filters and swaps the program
//! atomically while a stream of allowed flows sees no drop and denied
//! flows never pass. Needs root.

use std::net::Ipv4Addr;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use crate::ebpf_common::*;
use npm_dataplane::ebpf::{AttachMode, EbpfDataplane, EbpfOptions, VERDICT_ALLOW};
use npm_dataplane::Dataplane;
use npm_policy::model::Protocol;

const CHILD_ENV: &str = "NPM_EBPF_RESTART_CHILD";
const TCP_PORT: u16 = 8080;
const UDP_ALLOWED: u16 = 5353;
const UDP_DENIED: u16 = 5354;

fn policy(pod: Ipv4Addr, peer: Ipv4Addr) -> npm_policy::compiled::Compiled {
    policy_for(pod, peer, &[(Protocol::Tcp, TCP_PORT), (Protocol::Udp, UDP_ALLOWED)])
}

/// Entry point of the loader child process (the test binary re-invoked
/// with `NPM_EBPF_RESTART_CHILD=<pin dir>|<ifindex>|<pod ip>|<peer ip>|<mode>`).
/// Without that variable (a normal test run) it has nothing to do.
#[test]
fn restart_child_entry() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let parts: Vec<&str> = spec.split('|').collect();
    let [pin, ifindex, pod, peer, mode] = parts[..] else {
        panic!("bad {CHILD_ENV}: {spec}");
    };
    let mut dp = EbpfDataplane::open(EbpfOptions {
        object: None,
        pin_dir: pin.into(),
        bench_no_ct_create: false,
        attach: mode.parse().expect("attach mode"),
    })
    .expect("child open");
    let c = policy(pod.parse().unwrap(), peer.parse().unwrap());
    dp.sync_full(&c, &ifaces(&[(1, ifindex.parse().unwrap())]))
        .expect("child sync");
    // Exit without detaching: the pinned links keep the program attached.
}

#[test]
fn enforcement_survives_loader_restart_tcx() {
    enforcement_survives_loader_restart(AttachMode::Tcx, "rs");
}

#[test]
fn enforcement_survives_loader_restart_tc() {
    // npm tc filters: not while `auto` is tested (ebpf_attach_modes).
    let _g = crate::serial();
    enforcement_survives_loader_restart(AttachMode::Tc, "rc");
}

fn enforcement_survives_loader_restart(mode: AttachMode, tag: &str) {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    sweep_leftovers();
    let pins = PinDir::new(tag);
    let mut net = PodNet::new(tag);
    net.start_servers(TCP_PORT, &[UDP_ALLOWED, UDP_DENIED]);
    net.wait_ready(TCP_PORT, UDP_DENIED);

    // 1. A loader process programs, pins and exits.
    let spec = format!(
        "{}|{}|{}|{}|{mode}",
        pins.path.display(),
        net.ifindex,
        net.pod_ip,
        net.peer_ip
    );
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "ebpf_restart::restart_child_entry",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, &spec)
        .output()
        .expect("spawn loader child");
    assert!(
        out.status.success(),
        "loader child failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    // 2. No loader runs: still enforced.
    let (ing_before, eg_before) = prog_ids(&net.host_if, mode);
    assert_eq!((ing_before.len(), eg_before.len()), (1, 1), "one program per hook");
    let t = Duration::from_secs(2);
    let short = Duration::from_millis(500);
    net.tcp_exchange(TCP_PORT, t).expect("allowed TCP with no loader");
    net.udp_exchange(UDP_ALLOWED, t).expect("allowed UDP with no loader");
    assert!(
        net.udp_exchange(UDP_DENIED, short).is_err(),
        "denied UDP passed with no loader"
    );

    // 3. A new loader adopts maps and links and swaps the program while
    // allowed and denied flows stream.
    let stop = AtomicBool::new(false);
    let (ok, lost, denied_tries, denied_passed) = (
        AtomicU32::new(0),
        AtomicU32::new(0),
        AtomicU32::new(0),
        AtomicU32::new(0),
    );
    // The client ports of lost exchanges, to tell afterwards from the
    // kernel's own state where each was lost.
    let lost_ports = std::sync::Mutex::new(Vec::<(u16, u64)>::new());
    // Measurement by hand (`NPM_RESTART_UNTHROTTLED=1`): the exchanges
    // back to back, new flows as fast as the client goes (client ports up
    // to 65,000, ephemeral ones in use skipped); the drops of conntrack inserts the kernel refused
    // are printed (`conntrack-failed`).
    let unthrottled = std::env::var_os("NPM_RESTART_UNTHROTTLED").is_some();
    let mut events = Vec::new();
    std::thread::scope(|s| {
        s.spawn(|| {
            // Each exchange from its own client port, none used twice in
            // the run (an exchange every 200 us or more: a few thousand),
            // so a lost exchange's conntrack entry is its own.
            let mut port = FIRST_CLIENT_PORT;
            let last = if unthrottled { 65_000 } else { LAST_CLIENT_PORT };
            while !stop.load(Ordering::Relaxed) && port < last {
                port += 1;
                let sent = monotonic_ns();
                match udp_exchange_from(&net, port, UDP_ALLOWED, short) {
                    Ok(true) => {
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                    // The port is someone else's: not an exchange.
                    Ok(false) => {}
                    Err(()) => {
                        lost.fetch_add(1, Ordering::Relaxed);
                        lost_ports.lock().unwrap().push((port, sent));
                    }
                }
                if !unthrottled {
                    std::thread::sleep(Duration::from_micros(200));
                }
            }
        });
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                denied_tries.fetch_add(1, Ordering::Relaxed);
                if net.udp_exchange(UDP_DENIED, Duration::from_millis(100)).is_ok() {
                    denied_passed.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        std::thread::sleep(Duration::from_millis(300));
        let mut dp = pins.open_in(mode);
        assert_eq!(dp.attach_mode(), mode);
        dp.sync_full(&policy(net.pod_ip, net.peer_ip), &ifaces(&[(1, net.ifindex)]))
            .expect("new loader sync");
        std::thread::sleep(Duration::from_millis(300));
        // This loader's deny events (its ring buffer goes with it).
        events = dp.poll_deny_events();
        drop(dp);
        std::thread::sleep(Duration::from_millis(200));
        stop.store(true, Ordering::Relaxed);
    });
    let (ok, lost) = (ok.into_inner(), lost.into_inner());
    // A lost exchange is known only at its timeout, after the swap: the
    // conntrack entries are read from the pins once every exchange ended.
    let after = pins.open_in(mode);
    let (by_npm, evidence) = if lost > 0 {
        lost_evidence(&after.ct_entries(), &events, &lost_ports.lock().unwrap())
    } else {
        (0, String::new())
    };
    // New flows dropped because the kernel did not write their conntrack
    // entry (counted by every program of this layout, the child's too).
    let failed = after
        .read_counters()
        .map(|c| c.packets_both_ways(npm_common::Reason::ConntrackFailed))
        .unwrap_or_default();
    drop(after);
    let (denied_tries, denied_passed) = (denied_tries.into_inner(), denied_passed.into_inner());
    println!(
        "swap: {ok} allowed flows answered, {lost} lost; {denied_tries} denied tries, {denied_passed} passed; \
         {failed} dropped as conntrack-failed"
    );
    assert!(ok >= 20, "too few allowed flows measured: {ok}");
    // A lost exchange whose request created its conntrack entry and whose
    // reply passed `from_pod` (CT_SEEN_REPLY), with no deny event, passed
    // both of npm's programs: lost elsewhere (a datagram of the host's
    // stack), not a verdict. Any other loss is npm's.
    if lost > 0 {
        println!("lost exchanges: {evidence}");
    }
    assert_eq!(
        by_npm, 0,
        "allowed flows dropped during the program swap; what the kernel shows of the lost ones: {evidence}"
    );
    assert!(lost <= 5, "{lost} exchanges lost outside npm: {evidence}");
    assert!(denied_tries >= 3, "too few denied tries: {denied_tries}");
    assert_eq!(denied_passed, 0, "denied flows passed during the swap");

    // 4. The program was replaced in the same links or filters (no second
    // attachment).
    let (ing_after, eg_after) = prog_ids(&net.host_if, mode);
    assert_eq!((ing_after.len(), eg_after.len()), (1, 1), "one program per hook");
    assert_ne!(ing_after, ing_before, "ingress program not replaced");
    assert_ne!(eg_after, eg_before, "egress program not replaced");
    assert!(net.udp_exchange(UDP_DENIED, short).is_err());
    net.udp_exchange(UDP_ALLOWED, t).expect("allowed after swap");
}

/// The client ports of the swap's allowed exchanges (below the
/// ephemeral range, 32768 and up).
const FIRST_CLIENT_PORT: u16 = 20_000;
const LAST_CLIENT_PORT: u16 = 32_000;

/// One UDP exchange with the pod's `port` from client port `mine`:
/// `Ok(true)` answered, `Ok(false)` the client port is taken, `Err` no
/// answer within `timeout`.
fn udp_exchange_from(net: &PodNet, mine: u16, port: u16, timeout: Duration) -> Result<bool, ()> {
    let Ok(u) = std::net::UdpSocket::bind((net.peer_ip, mine)) else {
        return Ok(false);
    };
    u.set_read_timeout(Some(timeout)).map_err(|_| ())?;
    u.send_to(b"ping", (net.pod_ip, port)).map_err(|_| ())?;
    let mut buf = [0u8; 64];
    match u.recv_from(&mut buf) {
        Ok((n, _)) if &buf[..n] == b"ping" => Ok(true),
        _ => Err(()),
    }
}

/// `CLOCK_MONOTONIC` in ns, the clock of the conntrack entries' times.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// What the kernel holds of the lost exchanges (client port, time sent)
/// `ports`, and how many of them npm may have dropped: every one but those
/// whose conntrack entry this exchange's request created (no earlier than
/// the send, less the datapath clock's tick) and whose reply passed
/// `from_pod` (`CT_SEEN_REPLY`), with no deny event naming the port.
fn lost_evidence(
    ct: &[(npm_common::CtKey, npm_common::CtValue)],
    events: &[npm_common::DenyEvent],
    ports: &[(u16, u64)],
) -> (usize, String) {
    let mut by_npm = 0;
    let text = ports
        .iter()
        .map(|(p, sent)| {
            let entry = ct.iter().find(|(k, _)| {
                k.protocol == 17
                    && ((k.port_lo == *p && k.port_hi == UDP_ALLOWED) || (k.port_hi == *p && k.port_lo == UDP_ALLOWED))
            });
            let denies: Vec<String> = events
                .iter()
                .filter(|e| e.sport == *p || e.dport == *p)
                .map(|e| format!("direction {} reason {}", e.direction, e.reason))
                .collect();
            let tick = 10_000_000;
            let passed = entry
                .is_some_and(|(_, v)| v.created_ns + tick >= *sent && v.flags & npm_common::CT_SEEN_REPLY != 0)
                && denies.is_empty();
            if !passed {
                by_npm += 1;
            }
            let rel = |t: u64| t as i64 - *sent as i64;
            let entry = entry.map(|(_, v)| {
                format!(
                    "flags {:#x} reason {}, created {} ns and last seen {} ns after the send",
                    v.flags,
                    v.reason,
                    rel(v.created_ns),
                    rel(v.last_seen_ns)
                )
            });
            format!(
                "port {p}: conntrack {entry:?}, deny events {denies:?}{}",
                if passed { " (passed npm both ways)" } else { "" }
            )
        })
        .collect::<Vec<_>>()
        .join("; ");
    (by_npm, text)
}

#[test]
fn other_map_layouts_are_retired_after_the_first_full_sync_tcx() {
    other_map_layouts_are_retired_after_the_first_full_sync(AttachMode::Tcx, "ly");
}

#[test]
fn other_map_layouts_are_retired_after_the_first_full_sync_tc() {
    // npm tc filters: not while `auto` is tested (ebpf_attach_modes).
    let _g = crate::serial();
    other_map_layouts_are_retired_after_the_first_full_sync(AttachMode::Tc, "lc");
}

fn other_map_layouts_are_retired_after_the_first_full_sync(mode: AttachMode, tag: &str) {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    sweep_leftovers();
    // <root>/v<old> holds an older agent's maps and links (or filters);
    // <root>/v<current> is ours; <root>/keep is not a layout directory.
    let root = PinDir::new(tag);
    let veth_a = Dummy::new(&format!("{tag}a"));
    let veth_b = Dummy::new(&format!("{tag}b"));
    let old_dir = root.path.join(format!("v{}", npm_common::LAYOUT_VERSION - 1));
    let new_dir = root.path.join(format!("v{}", npm_common::LAYOUT_VERSION));
    let keep = root.path.join("keep");
    std::fs::create_dir_all(&keep).unwrap();
    let open = |dir: &std::path::Path| {
        EbpfDataplane::open(EbpfOptions {
            object: None,
            pin_dir: dir.to_path_buf(),
            bench_no_ct_create: false,
            attach: mode,
        })
        .expect("open")
    };
    // Endpoint 1 (10.9.0.1 on veth a) admits 10.9.0.2 on TCP 8080;
    // endpoint 2 (10.9.0.9 on veth b) is isolated with no rule.
    let mut c = policy(Ipv4Addr::new(10, 9, 0, 1), Ipv4Addr::new(10, 9, 0, 2));
    c.endpoints
        .insert(2, endpoint("other", 257, Some("10.9.0.9"), None, true, true));
    let both = ifaces(&[(1, veth_a.ifindex), (2, veth_b.ifindex)]);
    let syn = v4("10.9.0.2", "10.9.0.1", L4::Tcp(40100, TCP_PORT, 0x02));
    let synack = v4("10.9.0.1", "10.9.0.2", L4::Tcp(TCP_PORT, 40100, 0x12));
    let ack = v4("10.9.0.2", "10.9.0.1", L4::Tcp(40100, TCP_PORT, 0x10));
    {
        let mut old = open(&old_dir);
        old.sync_full(&c, &both).unwrap();
        // An established connection, tracked by the old layout.
        use npm_policy::compiled::Direction::{Egress, Ingress};
        assert_eq!(old.test_run(Ingress, veth_a.ifindex, &syn).unwrap().0, VERDICT_ALLOW);
        assert_eq!(old.test_run(Egress, veth_a.ifindex, &synack).unwrap().0, VERDICT_ALLOW);
    }
    let (old_a, _) = prog_ids(&veth_a.name, mode);
    let (old_b, old_b_eg) = prog_ids(&veth_b.name, mode);
    assert_eq!(
        (old_a.len(), old_b.len()),
        (1, 1),
        "the old layout's programs stay attached"
    );

    // The new layout copies the old conntrack on open, before it attaches.
    let mut new = open(&new_dir);
    assert_eq!(new.ct_len(), 1, "conntrack copied from the old layout");
    // The copied flows are keyed by the old layout's endpoint ids: its
    // records are what the agent adopts (to keep those ids).
    let mut adopted: Vec<(u32, u32)> = new.adopted_endpoints().iter().map(|a| (a.id, a.ifindex)).collect();
    adopted.sort();
    assert_eq!(adopted, vec![(1, veth_a.ifindex), (2, veth_b.ifindex)]);
    // Its first full sync cannot resolve veth b: b keeps the old program
    // (and the old layout its pins) rather than being left unenforced.
    let mut policy_change = c.clone();
    policy_change.policy.clear();
    new.sync_full(&policy_change, &ifaces(&[(1, veth_a.ifindex)])).unwrap();
    let (new_a, _) = prog_ids_settled(&veth_a.name, mode, (1, 1));
    assert_eq!(new_a.len(), 1, "only this layout's program on a");
    assert_ne!(new_a, old_a);
    assert_eq!(
        prog_ids(&veth_b.name, mode),
        (old_b.clone(), old_b_eg.clone()),
        "b keeps the old program"
    );
    assert!(
        old_dir.join("links").exists(),
        "the old layout is kept while it still enforces somewhere"
    );
    // The established connection survives the upgrade although its rule is
    // gone (established flows are not re-evaluated).
    assert_eq!(
        new.test_run(npm_policy::compiled::Direction::Ingress, veth_a.ifindex, &ack)
            .unwrap(),
        (VERDICT_ALLOW, Some(npm_common::Reason::Tracked))
    );

    // Once b is attached too, the old layout goes.
    new.sync_full(&c, &both).unwrap();
    let (new_b, new_b_eg) = prog_ids_settled(&veth_b.name, mode, (1, 1));
    assert_eq!((new_b.len(), new_b_eg.len()), (1, 1));
    assert_ne!(new_b, old_b);
    assert!(!old_dir.exists(), "the old layout's pins are removed");
    assert!(new_dir.join("links").exists());
    assert!(keep.exists(), "a directory that is not a layout is left alone");
    assert!(new.retire_other_layouts().unwrap().is_empty());
}

#[test]
fn a_restart_that_renumbers_endpoints_drops_only_their_flows() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    use npm_policy::compiled::Direction::{Egress, Ingress};
    sweep_leftovers();
    let pins = PinDir::new("rn");
    let veth_a = Dummy::new("rna");
    let veth_b = Dummy::new("rnb");
    let peer = "10.9.1.2";
    let with = |eps: &[(u32, &str)]| {
        let mut c = npm_policy::compiled::Compiled::default();
        ip(&mut c, peer, 300, 0);
        for (id, addr) in eps {
            c.endpoints
                .insert(*id, endpoint(&format!("p{id}"), 256, Some(addr), None, true, true));
            ip(&mut c, addr, 256, 0);
            allow(
                &mut c,
                *id,
                Ingress,
                300,
                Some(Protocol::Tcp),
                (TCP_PORT, TCP_PORT),
                *id,
            );
        }
        c
    };
    let ifs = ifaces(&[(1, veth_a.ifindex), (2, veth_b.ifindex)]);
    let establish = |dp: &EbpfDataplane, ifindex: u32, addr: &str| {
        let syn = v4(peer, addr, L4::Tcp(40200, TCP_PORT, 0x02));
        let synack = v4(addr, peer, L4::Tcp(TCP_PORT, 40200, 0x12));
        assert_eq!(dp.test_run(Ingress, ifindex, &syn).unwrap().0, VERDICT_ALLOW);
        assert_eq!(dp.test_run(Egress, ifindex, &synack).unwrap().0, VERDICT_ALLOW);
    };
    {
        let mut dp = pins.open();
        dp.sync_full(&with(&[(1, "10.9.1.1"), (2, "10.9.1.9")]), &ifs).unwrap();
        establish(&dp, veth_a.ifindex, "10.9.1.1");
        establish(&dp, veth_b.ifindex, "10.9.1.9");
        assert_eq!(dp.ct_len(), 2);
    }
    // A new agent numbers anew: id 1 is the same pod on the same veth; id 2
    // is now another pod (another address) on veth b.
    let mut dp = pins.open();
    dp.sync_full(&with(&[(1, "10.9.1.1"), (2, "10.9.1.7")]), &ifs).unwrap();
    let kept: Vec<u32> = dp.ct_entries().iter().map(|(k, _)| k.endpoint).collect();
    assert_eq!(kept, vec![1], "only the unchanged endpoint keeps its flows");
    let ack = v4(peer, "10.9.1.1", L4::Tcp(40200, TCP_PORT, 0x10));
    assert_eq!(
        dp.test_run(Ingress, veth_a.ifindex, &ack).unwrap(),
        (VERDICT_ALLOW, Some(npm_common::Reason::Tracked))
    );
    drop(dp);

    // Flows under an id no record carries are orphans (say, left by a
    // crash between a record's removal and its purge): a new agent that
    // gives that id to a pod (pod 3 on veth b) must not let it inherit them.
    let dp = pins.open();
    let orphan = dp.ct_entries()[0];
    {
        use aya::maps::{HashMap as BpfHashMap, Map, MapData};
        let data = MapData::from_pin(pins.path.join(npm_common::maps::CT4)).unwrap();
        let mut ct4: BpfHashMap<MapData, npm_common::CtKey4, npm_common::CtValue> =
            BpfHashMap::try_from(Map::from_map_data(data).unwrap()).unwrap();
        let mut key: npm_common::CtKey4 = ct4.keys().next().unwrap().unwrap();
        key.endpoint = 3;
        ct4.insert(key, orphan.1, 0).unwrap();
    }
    assert_eq!(dp.ct_len(), 2);
    let mut dp = dp;
    let ifs3 = ifaces(&[(1, veth_a.ifindex), (3, veth_b.ifindex)]);
    dp.sync_full(&with(&[(1, "10.9.1.1"), (3, "10.9.1.7")]), &ifs3).unwrap();
    let kept: Vec<u32> = dp.ct_entries().iter().map(|(k, _)| k.endpoint).collect();
    assert_eq!(kept, vec![1], "the orphan under the new id is gone");
}

/// Creates a map (`BPF_MAP_CREATE`: type, key and value sizes, entries)
/// and pins it at `path` (`BPF_OBJ_PIN`): the maps of a layout this build's
/// object no longer has.
fn pin_new_map(path: &std::path::Path, map_type: u32, key: usize, value: usize, entries: u32) {
    use std::os::unix::ffi::OsStrExt;
    // bpf_attr for BPF_MAP_CREATE: map_type, key_size, value_size,
    // max_entries, the rest zero.
    let mut create = [0u32; 18];
    create[..4].copy_from_slice(&[map_type, key as u32, value as u32, entries]);
    // SAFETY: a zeroed bpf_attr of the size given, alive for the call.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, 0, create.as_mut_ptr(), std::mem::size_of_val(&create)) };
    assert!(
        fd >= 0,
        "BPF_MAP_CREATE {}: {}",
        path.display(),
        std::io::Error::last_os_error()
    );
    let name = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    // bpf_attr for BPF_OBJ_PIN: pathname (u64), bpf_fd (u32), file_flags.
    let mut pin = [0u64; 3];
    pin[0] = name.as_ptr() as u64;
    pin[1] = fd as u64;
    // SAFETY: as above; `name` outlives the call.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, 6, pin.as_mut_ptr(), std::mem::size_of_val(&pin)) };
    assert_eq!(
        rc,
        0,
        "BPF_OBJ_PIN {}: {}",
        path.display(),
        std::io::Error::last_os_error()
    );
    // SAFETY: our own descriptor; the pin keeps the map.
    unsafe { libc::close(fd as i32) };
}

/// An upgrade from layout 5 (40-byte endpoint records without the
/// subject): the new layout copies the conntrack, reads the old records for
/// the ids its flows carry (so the agent keeps them), and its first full
/// sync keeps the flows of the endpoint they still describe. The old
/// layout is made here with the maps' shapes of layout 5 (this build's
/// object has the 44-byte record).
#[test]
fn an_upgrade_from_layout_5_keeps_the_flows_of_its_records() {
    upgrade_from(5);
}

/// An upgrade of a running node from layout 6 (the last layout with the
/// policy and tier fronts and the decision cache): the same record size,
/// but other flag bits (the tier flags at bits 15 to 18, the front flags
/// at 11 to 14). The conntrack is copied (the value's reserved bytes are
/// layout 7's decision epoch, 0), the records' isolation and tier flags are
/// read at their layout-6 bits (a front flag is no tier), and after the
/// first full sync nothing opens: the copied flow is tracked, a new flow
/// the policy does not allow is denied.
#[test]
fn an_upgrade_from_layout_6_keeps_its_flows_and_opens_nothing() {
    upgrade_from(6);
}

/// The upgrade to this layout from pins of layout `old` (5 or 6) made
/// with that layout's shapes and flag bits.
fn upgrade_from(old: u32) {
    use aya::maps::{Array, HashMap as BpfHashMap, Map, MapData};
    use npm_common::{maps, CtKey, CtKey4, CtValue, FragKey, FragValue, IpInfo, IpKey};
    use npm_policy::compiled::Direction::Ingress;
    use std::mem::size_of;
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    // Layouts 7 and later read the records of 5 and 6 with
    // `flags_before_layout_7`; layout 7's own (the same record) are the
    // previous layout of `other_map_layouts_are_retired_*`.
    const {
        assert!(
            npm_common::LAYOUT_VERSION >= 7,
            "this test makes the maps of layouts 5 and 6"
        )
    };
    // The layout-5/6 flag bits: isolated ingress 0, IPv4 2, present 10,
    // the policy front (ingress) 11, the Admin tier (ingress) 15, the
    // Baseline tier (egress) 18.
    const OLD_ISOLATED_INGRESS: u32 = 1 << 0;
    const OLD_HAS_V4: u32 = 1 << 2;
    const OLD_PRESENT: u32 = 1 << 10;
    const OLD_FRONT_INGRESS: u32 = 1 << 11;
    const OLD_ADMIN_INGRESS: u32 = 1 << 15;
    const OLD_BASELINE_EGRESS: u32 = 1 << 18;
    sweep_leftovers();
    let tag = format!("l{old}");
    let root = PinDir::new(&tag);
    let veth = Dummy::new(&format!("{tag}a"));
    let old_dir = root.path.join(format!("v{old}"));
    let new_dir = root.path.join(format!("v{}", npm_common::LAYOUT_VERSION));
    std::fs::create_dir_all(&old_dir).unwrap();
    const HASH: u32 = 1;
    const ARRAY: u32 = 2;
    const LRU_HASH: u32 = 9;
    let record_len = if old == 5 { 40 } else { 44 };
    let pin = |name: &str, t, k, v, n| pin_new_map(&old_dir.join(name), t, k, v, n);
    pin(maps::EP_SLOTS, ARRAY, 4, record_len, npm_common::sizes::ENDPOINT_SLOTS);
    pin(maps::ENDPOINTS, HASH, 4, record_len, 64);
    pin(maps::IPCACHE, HASH, size_of::<IpKey>(), size_of::<IpInfo>(), 64);
    pin(maps::CT, LRU_HASH, size_of::<CtKey>(), size_of::<CtValue>(), 64);
    pin(maps::CT4, LRU_HASH, size_of::<CtKey4>(), size_of::<CtValue>(), 64);
    pin(maps::FRAGS, LRU_HASH, size_of::<FragKey>(), size_of::<FragValue>(), 64);
    let open_old = |name: &str| Map::from_map_data(MapData::from_pin(old_dir.join(name)).unwrap()).unwrap();
    // Endpoint 7 (10.9.5.1 on the veth) as the old layout wrote it: id,
    // flags, IPv4-mapped address, IPv6 address (and, from layout 6, the
    // subject); and one of its flows, the value as the old datapath wrote
    // it (its reserved bytes 0).
    let pod = Ipv4Addr::new(10, 9, 5, 1);
    let flags = OLD_PRESENT
        | OLD_HAS_V4
        | OLD_ISOLATED_INGRESS
        | OLD_FRONT_INGRESS
        | if old == 6 {
            OLD_ADMIN_INGRESS | OLD_BASELINE_EGRESS
        } else {
            0
        };
    let mut record = [0u8; 44];
    record[..4].copy_from_slice(&7u32.to_ne_bytes());
    record[4..8].copy_from_slice(&flags.to_ne_bytes());
    record[8..24].copy_from_slice(&IpKey::v4(pod.octets()).addr);
    record[40..44].copy_from_slice(&256u32.to_ne_bytes());
    if old == 5 {
        let mut slots: Array<MapData, [u8; 40]> = Array::try_from(open_old(maps::EP_SLOTS)).unwrap();
        let short: [u8; 40] = record[..40].try_into().unwrap();
        slots.set(veth.ifindex, short, 0).unwrap();
    } else {
        let mut slots: Array<MapData, [u8; 44]> = Array::try_from(open_old(maps::EP_SLOTS)).unwrap();
        slots.set(veth.ifindex, record, 0).unwrap();
    }
    let mut ct4: BpfHashMap<MapData, CtKey4, CtValue> = BpfHashMap::try_from(open_old(maps::CT4)).unwrap();
    let key = CtKey4 {
        endpoint: 7,
        protocol: 6,
        addr_lo: pod.octets(),
        addr_hi: [10, 9, 5, 2],
        port_lo: TCP_PORT,
        port_hi: 40000,
        ..CtKey4::default()
    };
    // Established (a reply seen), opened by the peer (addr_hi) towards
    // the pod, recently.
    let now = {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: a valid timespec we own.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    };
    let value = CtValue {
        last_seen_ns: now,
        created_ns: now,
        origin_direction: npm_common::DIR_INGRESS,
        flags: npm_common::CT_SEEN_REPLY,
        reason: npm_common::Reason::Policy as u8,
        ..CtValue::default()
    };
    ct4.insert(key, value, 0).unwrap();
    drop(ct4);

    let mut new = EbpfDataplane::open(EbpfOptions {
        object: None,
        pin_dir: new_dir.clone(),
        bench_no_ct_create: false,
        attach: AttachMode::Tcx,
    })
    .expect("open");
    assert_eq!(new.ct_len(), 1, "conntrack copied from layout {old}");
    assert_eq!(new.ct_entries()[0].1.epoch, 0, "the copied value's epoch");
    let adopted: Vec<_> = new
        .adopted_endpoints()
        .iter()
        .map(|a| {
            (
                a.id,
                a.ifindex,
                a.ipv4,
                a.isolated_ingress,
                a.isolated_egress,
                a.tiered_directions,
            )
        })
        .collect();
    // Layout 6's tier bits are its two tiered directions; its front bit
    // (bit 11, this layout's Admin ingress flag) is none.
    let tiered = if old == 6 { 2 } else { 0 };
    assert_eq!(
        adopted,
        vec![(7, veth.ifindex, Some(pod), true, false, tiered)],
        "layout {old}'s records read at its own bits"
    );
    // The agent keeps id 7 for the pod the record describes: its flow stays
    // and is still tracked, while a new flow the policy does not allow is
    // denied (ingress-isolated, no rule).
    let mut c = npm_policy::compiled::Compiled::default();
    c.endpoints
        .insert(7, endpoint("pod", 256, Some("10.9.5.1"), None, true, false));
    ip(&mut c, "10.9.5.1", 256, 0);
    ip(&mut c, "10.9.5.2", 300, 0);
    new.sync_full(&c, &ifaces(&[(7, veth.ifindex)])).unwrap();
    assert_eq!(new.ct_len(), 1, "the flow of the endpoint its record describes is kept");
    let ack = v4("10.9.5.2", "10.9.5.1", L4::Tcp(40000, TCP_PORT, 0x10));
    assert_eq!(
        new.test_run(Ingress, veth.ifindex, &ack).unwrap(),
        (VERDICT_ALLOW, Some(npm_common::Reason::Tracked)),
        "the copied flow is tracked"
    );
    let syn = v4("10.9.5.2", "10.9.5.1", L4::Tcp(40001, TCP_PORT, 0x02));
    assert_eq!(
        new.test_run(Ingress, veth.ifindex, &syn).unwrap(),
        (
            npm_dataplane::ebpf::VERDICT_DROP,
            Some(npm_common::Reason::PolicyDenied)
        ),
        "a new flow the policy does not allow is denied"
    );
    assert!(!old_dir.exists(), "layout {old}'s pins are retired after the full sync");
}
