//! `npm-agent explain` against a live agent (single node, x/y/z pods): a
//! policy isolates `y/b` for ingress and allows `x/a` on TCP 80 only.
//! Explain (the real CLI, `--json`, against the agent's `/explain`) must
//! say allow on 80 naming the policy and its rule, deny on 81 naming the
//! isolating policy; on eBPF the kernel's verdict (the attached programs
//! run as a dry run) must agree, on nftables it is `null`. On eBPF the
//! dry runs must leave no conntrack entry (the pinned maps counted by
//! `npm-agent inspect` before and after), count no packet, and a real
//! probe afterwards still behaves per policy. An IP address works as an
//! endpoint as well as `NS/POD`. A forced mismatch (eBPF): `y/b`'s ingress
//! isolation is cleared in the kernel's endpoint record behind the agent's
//! back; explain must print the disagreement first and count it.
//!
//! Needs root and the agent binary (`cargo build --bin npm-agent`, or
//! `NPM_AGENT_BIN`); the eBPF variant also the BPF object
//! (`NPM_EBPF_OBJECT`, as `cargo xtask test` sets it).

use std::process::Command;
use std::time::Instant;

use npm_e2e::fixtures::{agent_bin, probe_config, start_with_setup, tcp_probe as probe, wait_enforced, ALLOW_XA_80};
use npm_e2e::probe::probe_all;
use npm_e2e::runner::{Engine, LiveRunner};
use serde_json::Value;

/// `npm-agent explain --json` from `from` to `to` on TCP `port`.
fn explain(r: &LiveRunner, from: &str, to: &str, port: u16, json: bool) -> String {
    let addr = r.debug_addr().expect("the agent's debug address");
    let mut cmd = Command::new(agent_bin());
    cmd.args([
        "explain",
        "--agent",
        &format!("http://{addr}"),
        "--from",
        from,
        "--to",
        to,
    ])
    .args(["--port", &port.to_string(), "--protocol", "TCP"]);
    if json {
        cmd.arg("--json");
    }
    let out = cmd.output().expect("run npm-agent explain");
    assert!(
        out.status.success(),
        "explain failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

fn explain_json(r: &LiveRunner, from: &str, to: &str, port: u16) -> Value {
    let text = explain(r, from, to, port, true);
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

/// `ct_entries` and the non-zero counters of `npm-agent inspect --json`.
fn inspect(r: &LiveRunner) -> (u64, Value) {
    let out = Command::new(agent_bin())
        .args(["inspect", "--json", "--pin-dir"])
        .arg(r.pin_dir())
        .output()
        .expect("run npm-agent inspect");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).expect("inspect JSON");
    // Only y/b receives these: nothing else moves them while explain runs.
    let policy: Vec<Value> = v["counters"]
        .as_array()
        .expect("counters")
        .iter()
        .filter(|c| c["direction"] == "ingress" && c["reason"].as_str().is_some_and(|r| r.contains("olic")))
        .cloned()
        .collect();
    (v["ct_entries"].as_u64().expect("ct_entries"), Value::Array(policy))
}

fn ingress(v: &Value) -> &Value {
    v["directions"]
        .as_array()
        .and_then(|d| d.iter().find(|d| d["direction"] == "ingress"))
        .expect("an ingress direction")
}

fn run(engine: Engine) {
    let t0 = Instant::now();
    let r = start_with_setup(engine, &[], ALLOW_XA_80);
    let cfg = probe_config(&r, 2);
    let allowed = [probe(&r, "x/a", "y/b", 80)];
    let denied = [probe(&r, "x/a", "y/b", 81), probe(&r, "z/c", "y/b", 80)];
    // Enforced: 80 connects, 81 and z/c do not.
    wait_enforced(&format!("{engine:?}"), &cfg, &allowed, &denied);
    let before = (engine == Engine::Ebpf).then(|| inspect(&r));

    let allow = explain_json(&r, "x/a", "y/b", 80);
    let deny = explain_json(&r, "x/a", "y/b", 81);
    let by_ip = explain_json(&r, &r.cluster().pod("z", "c").unwrap().ipv4.to_string(), "y/b", 80);
    let text = explain(&r, "x/a", "y/b", 81, false);
    eprintln!("{engine:?} allow: {allow}\n{engine:?} deny: {deny}\n{engine:?} text:\n{text}");

    assert_eq!(allow["verdict"], "allow", "{allow}");
    assert_eq!(allow["mismatch"], Value::Null, "{allow}");
    let rule = &ingress(&allow)["policies"][0];
    assert_eq!(
        (&rule["namespace"], &rule["name"], &rule["rule"], &rule["effect"]),
        (
            &"y".into(),
            &"allow-xa-80".into(),
            &"ingress[0]".into(),
            &"allow".into()
        ),
        "{allow}"
    );
    assert_eq!(ingress(&allow)["reason"], "Policy", "{allow}");
    assert_eq!(deny["verdict"], "deny", "{deny}");
    assert_eq!(deny["mismatch"], Value::Null, "{deny}");
    assert_eq!(ingress(&deny)["reason"], "PolicyDenied", "{deny}");
    let iso = &ingress(&deny)["policies"][0];
    assert_eq!(
        (&iso["namespace"], &iso["name"], &iso["effect"]),
        (&"y".into(), &"allow-xa-80".into(), &"isolates".into()),
        "{deny}"
    );
    assert_eq!(by_ip["verdict"], "deny", "{by_ip}");
    assert!(text.starts_with("DENIED "), "{text}");
    assert!(text.contains("y/allow-xa-80"), "{text}");

    match engine {
        Engine::Ebpf => {
            for (v, verdict, reason) in [
                (&allow, "allow", "Policy"),
                (&deny, "deny", "PolicyDenied"),
                (&by_ip, "deny", "PolicyDenied"),
            ] {
                let k = &ingress(v)["kernel"];
                assert_eq!((&k["verdict"], &k["reason"]), (&verdict.into(), &reason.into()), "{v}");
                assert_eq!(v["kernel"]["verdict"], verdict, "{v}");
            }
            // x/a's egress is local and not isolated: its program ran too.
            let egress = &allow["directions"][0];
            assert_eq!(egress["kernel"]["reason"], "NotIsolated", "{allow}");
            let (ct_before, counters_before) = before.unwrap();
            let (ct_after, counters_after) = inspect(&r);
            // Without the dry run: one entry per allowed hook (x/a's egress
            // and y/b's ingress on 80, z/c's egress) at least. The agent may
            // expire the probes' closed flows meanwhile, never add one.
            assert!(
                ct_after <= ct_before,
                "explain created conntrack entries: {ct_before} -> {ct_after}"
            );
            assert_eq!(counters_after, counters_before, "explain moved the verdict counters");
            assert!(text.contains("kernel: deny (PolicyDenied)"), "{text}");
        }
        _ => {
            assert_eq!(allow["kernel"], Value::Null, "{allow}");
            assert_eq!(ingress(&deny)["kernel"], Value::Null, "{deny}");
            assert!(text.contains("kernel: null"), "{text}");
        }
    }
    // A real probe afterwards still behaves per policy.
    assert!(probe_all(&allowed, &cfg)[0], "{engine:?}: 80 no longer connects");
    assert!(
        probe_all(&denied, &cfg).iter().all(|ok| !ok),
        "{engine:?}: 81 or z/c connects"
    );
    let metrics = std::process::Command::new("curl")
        .args(["-s", &format!("http://{}/metrics", r.metrics_addr().unwrap())])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    if !metrics.is_empty() {
        assert!(metrics.contains("npm_explain_mismatch_total 0"), "{metrics}");
    }
    r.shutdown().expect("shutdown");
    eprintln!("{engine:?}: {:?}", t0.elapsed());
}

/// One live cluster at a time (shared pod addresses).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Raw `bpf(2)` on pinned maps, for tampering with the kernel's state
/// behind the agent's back.
mod bpf {
    use std::ffi::CString;
    use std::os::fd::{FromRawFd, OwnedFd};
    use std::path::Path;

    /// Big enough for every `union bpf_attr` variant used here.
    #[repr(C, align(8))]
    #[derive(Default)]
    struct Attr {
        words: [u64; 16],
    }

    fn bpf(cmd: i64, attr: &mut Attr) -> std::io::Result<i64> {
        // SAFETY: `attr` outlives the call and is as large as the kernel reads.
        let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *mut Attr, std::mem::size_of::<Attr>()) };
        if r < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(r)
        }
    }

    /// `BPF_OBJ_GET` of a pinned map.
    pub fn open(path: &Path) -> OwnedFd {
        let c = CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        let mut a = Attr::default();
        a.words[0] = c.as_ptr() as u64;
        let fd = bpf(7, &mut a).unwrap_or_else(|e| panic!("BPF_OBJ_GET {}: {e}", path.display()));
        // SAFETY: a new descriptor this process owns.
        unsafe { OwnedFd::from_raw_fd(fd as i32) }
    }

    fn elem(cmd: i64, fd: &OwnedFd, key: &[u8], value: &mut [u8]) -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        let mut a = Attr::default();
        a.words[0] = fd.as_raw_fd() as u64;
        a.words[1] = key.as_ptr() as u64;
        a.words[2] = value.as_mut_ptr() as u64;
        bpf(cmd, &mut a).map(|_| ())
    }

    /// `BPF_MAP_LOOKUP_ELEM`.
    pub fn lookup(fd: &OwnedFd, key: &[u8], value: &mut [u8]) {
        elem(1, fd, key, value).expect("BPF_MAP_LOOKUP_ELEM");
    }

    /// `BPF_MAP_UPDATE_ELEM` (`BPF_ANY`).
    pub fn update(fd: &OwnedFd, key: &[u8], value: &mut [u8]) {
        elem(2, fd, key, value).expect("BPF_MAP_UPDATE_ELEM");
    }

    /// The pinned map `name` under `dir` (its layout directory).
    pub fn find(dir: &Path, name: &str) -> Option<std::path::PathBuf> {
        for e in std::fs::read_dir(dir).ok()?.flatten() {
            let p = e.path();
            if p.file_name().is_some_and(|n| n == name) {
                return Some(p);
            }
            if p.is_dir() {
                if let Some(found) = find(&p, name) {
                    return Some(found);
                }
            }
        }
        None
    }
}

/// Clears (or restores) `EP_ISOLATED_INGRESS` in the kernel's endpoint
/// record of `ifindex` behind the agent's back (the datapath caches no
/// decision: the next new flow reads it); returns the flags it found.
fn tamper_ingress_isolation(pin_dir: &std::path::Path, ifindex: u32, isolated: bool) -> u32 {
    let slots = bpf::find(pin_dir, "NPM_EP_SLOTS").expect("NPM_EP_SLOTS pinned");
    let fd = bpf::open(&slots);
    // `EndpointInfo`: id, flags, ipv4, ipv6, subject (44 bytes).
    let mut rec = [0u8; 44];
    bpf::lookup(&fd, &ifindex.to_ne_bytes(), &mut rec);
    let flags = u32::from_ne_bytes(rec[4..8].try_into().unwrap());
    let new = if isolated { flags | 1 } else { flags & !1 };
    rec[4..8].copy_from_slice(&new.to_ne_bytes());
    bpf::update(&fd, &ifindex.to_ne_bytes(), &mut rec);
    flags
}

/// A forced disagreement: y/b's ingress isolation is removed from the
/// kernel's endpoint record behind the agent's back. The kernel then
/// really lets x/a through to 81 (a real probe connects) while the agent
/// still says deny; `npm-agent explain` must print the mismatch first,
/// say what the kernel did, and count it in `npm_explain_mismatch_total`.
#[test]
fn explain_forced_mismatch_ebpf() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let t0 = Instant::now();
    let r = start_with_setup(Engine::Ebpf, &[], ALLOW_XA_80);
    let cfg = probe_config(&r, 1);
    let denied = [probe(&r, "x/a", "y/b", 81)];
    wait_enforced("ebpf", &cfg, &[], &denied);
    let agreed = explain_json(&r, "x/a", "y/b", 81);
    assert_eq!(agreed["mismatch"], Value::Null, "{agreed}");
    let ifindex = ingress(&agreed)["kernel"]["ifindex"].as_u64().expect("y/b's ifindex") as u32;

    let flags = tamper_ingress_isolation(r.pin_dir(), ifindex, false);
    assert_ne!(flags & 1, 0, "y/b's record was not ingress-isolated: {flags:#x}");
    // The kernel really disagrees now.
    assert!(probe_all(&denied, &cfg)[0], "x/a -> y/b:81 still denied by the kernel");
    let text = explain(&r, "x/a", "y/b", 81, false);
    let json = explain_json(&r, "x/a", "y/b", 81);
    eprintln!("forced mismatch:\n{text}{json}");
    let first = text.lines().next().unwrap_or("");
    assert!(
        first.starts_with(
            "MISMATCH on ingress of y/b: the agent says deny (PolicyDenied), the kernel says allow (NotIsolated"
        ),
        "the mismatch is not printed first:\n{text}"
    );
    assert!(text.contains("DENIED "), "{text}");
    assert!(
        json["mismatch"]
            .as_str()
            .is_some_and(|m| m.starts_with("MISMATCH on ingress of y/b")),
        "{json}"
    );
    assert_eq!(ingress(&json)["kernel"]["verdict"], "allow", "{json}");
    assert_eq!(json["verdict"], "deny", "the agent's view changed: {json}");
    let metrics = npm_e2e::fixtures::scrape_metrics(&r);
    assert!(metrics.contains("npm_explain_mismatch_total 2"), "{metrics}");

    // Put the record back: enforced again, and no mismatch.
    tamper_ingress_isolation(r.pin_dir(), ifindex, true);
    assert!(!probe_all(&denied, &cfg)[0], "x/a -> y/b:81 connects after the restore");
    assert_eq!(explain_json(&r, "x/a", "y/b", 81)["mismatch"], Value::Null);
    r.shutdown().expect("shutdown");
    eprintln!("forced mismatch: {:?}", t0.elapsed());
}

#[test]
fn explain_ebpf() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    run(Engine::Ebpf);
}

#[test]
fn explain_nftables() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    run(Engine::Nftables);
}
