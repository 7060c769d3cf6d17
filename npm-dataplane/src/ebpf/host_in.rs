//! The `host_in` program and its `INPUT` rules ([`HostIn`]): the deferred
//! egress decision of Service traffic whose backend kube-proxy chose on
//! this node's own host network (`kubernetes.default` on k3s, kind and
//! untainted control planes; hostNetwork ingress controllers, node
//! exporters, NodeLocal DNS). Such a packet is delivered to the node after
//! the DNAT and crosses no tc egress hook, so neither `to_pod` nor
//! `node_exit` sees it.
//!
//! `host_in` is a socket filter run by an `xt_bpf` match: one rule in a
//! chain of its own in the `filter` table of iptables and ip6tables,
//! jumped to first thing from `INPUT`:
//!
//! ```text
//! -A <chain> -m mark --mark 0x1000/0x1000 -m bpf --object-pinned <pin dir>/host_in -j DROP
//! ```
//!
//! The mark match keeps every other packet off the program. The program
//! decides the deferred egress against the packet's post-DNAT destination
//! exactly as `to_pod` and `node_exit` do (the node's own addresses are the
//! host identity: denied unless the policy allows the host, e.g. by
//! `--allow-host-egress` or an ipBlock covering the address) and answers 1
//! (a match: the rule drops) for a deny. The sender is the endpoint of
//! the device the packet entered the node by (or, for a bridged pod,
//! the one `from_pod` recorded for its source: `npm_common::service`),
//! never read from the mark. A packet deferred by an endpoint its maps do
//! not hold is another pin directory's (its own chain decides it): 0.
//!
//! Where the match cannot be installed (a kernel without `xt_bpf`, an
//! iptables without its `bpf` extension), the chain drops every deferred
//! packet instead ([`HostInMode::DropAll`]): a backend on the host network
//! is then unreachable for egress-isolated pods, never reachable
//! undecided. The chain is written whole by one `iptables-restore
//! --noflush` (no moment without its rule) and checked on every
//! [`HostIn::ensure`].

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use aya::programs::SocketFilter;
use aya::Ebpf;
use npm_common::DEFER_MARK;

use super::errors::{prog_err, EbpfError};
use super::loader::{load_beside_pins, load_or_reduced, BenchSwitches, Programs};

/// The socket filter deciding deferred flows delivered to the node.
pub const PROG_HOST_IN: &str = "host_in";
/// The prefix of the chains of the `INPUT` rules: one chain per pin
/// directory ([`host_in_chain`]).
pub const HOST_IN_CHAIN_PREFIX: &str = "NPM-SVC-IN-";

/// The chain of the pin directory `pin_dir`: [`HOST_IN_CHAIN_PREFIX`] and
/// 8 hex digits of the directory's FNV-1a hash. One chain per pin
/// directory, so that dataplanes of two pin directories in one network
/// namespace (a layout upgrade, tests) never rewrite each other's rule.
pub fn host_in_chain(pin_dir: &Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    let h = pin_dir
        .as_os_str()
        .as_bytes()
        .iter()
        .fold(0x811c_9dc5_u32, |h, &b| (h ^ b as u32).wrapping_mul(0x0100_0193));
    format!("{HOST_IN_CHAIN_PREFIX}{h:08x}")
}

/// `<pin_dir>/host_in`: where the program is pinned for `xt_bpf`.
pub fn host_in_pin(pin_dir: &Path) -> PathBuf {
    pin_dir.join(PROG_HOST_IN)
}

/// What the `INPUT` chain does with a deferred packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostInMode {
    /// Decided by `host_in` (the `xt_bpf` match).
    Decided,
    /// Dropped: the `xt_bpf` match could not be installed (fail closed).
    DropAll,
}

/// `host_in` loaded beside the pinned maps and pinned itself, and its
/// rules in the chain `chain` of iptables and ip6tables.
pub struct HostIn {
    _bpf: Ebpf,
    pin: PathBuf,
    chain: String,
    mode: HostInMode,
}

impl std::fmt::Debug for HostIn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostIn")
            .field("pin", &self.pin)
            .field("chain", &self.chain)
            .field("mode", &self.mode)
            .finish()
    }
}

/// The iptables binaries, one per family.
const BINS: [(&str, &str); 2] = [("iptables", "iptables-restore"), ("ip6tables", "ip6tables-restore")];

fn rule_err(cmd: String, message: impl Into<String>) -> EbpfError {
    EbpfError::Rule {
        cmd,
        message: message.into(),
    }
}

/// Runs `bin args`, its error output as the error.
fn run(bin: &str, args: &[&str]) -> Result<(), EbpfError> {
    let cmd = format!("{bin} {}", args.join(" "));
    let out = Command::new(bin)
        .args(args)
        .output()
        .map_err(|e| rule_err(cmd.clone(), e.to_string()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(rule_err(cmd, String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// Feeds `input` to `bin -w 5 --noflush` (one atomic commit).
fn restore(bin: &str, input: &str) -> Result<(), EbpfError> {
    let cmd = format!("{bin} -w 5 --noflush");
    let mut child = Command::new(bin)
        .args(["-w", "5", "--noflush"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| rule_err(cmd.clone(), e.to_string()))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(input.as_bytes())
            .map_err(|e| rule_err(cmd.clone(), e.to_string()))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| rule_err(cmd.clone(), e.to_string()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(rule_err(
            format!("{cmd} <<< {input:?}"),
            String::from_utf8_lossy(&out.stderr).trim(),
        ))
    }
}

/// The `--mark` argument matching the deferral bit.
fn mark_arg() -> String {
    format!("{DEFER_MARK:#x}/{DEFER_MARK:#x}")
}

/// The rule of `chain` in `mode` (iptables-save syntax, without `-A chain`).
fn rule(mode: HostInMode, pin: &Path) -> String {
    match mode {
        HostInMode::Decided => format!(
            "-m mark --mark {} -m bpf --object-pinned {} -j DROP",
            mark_arg(),
            pin.display()
        ),
        HostInMode::DropAll => format!("-m mark --mark {} -j DROP", mark_arg()),
    }
}

/// Writes `chain` of `bin`'s `filter` table as exactly the rule of `mode`
/// (created or replaced in one commit) and makes `INPUT` jump to it first.
fn write_chain(bin: &str, restore_bin: &str, chain: &str, mode: HostInMode, pin: &Path) -> Result<(), EbpfError> {
    restore(
        restore_bin,
        &format!("*filter\n:{chain} - [0:0]\n-A {chain} {}\nCOMMIT\n", rule(mode, pin)),
    )?;
    if run(bin, &["-w", "5", "-C", "INPUT", "-j", chain]).is_err() {
        run(bin, &["-w", "5", "-I", "INPUT", "1", "-j", chain])?;
    }
    Ok(())
}

/// Whether `bin`'s `chain` holds the rule of `mode` and `INPUT` jumps to it.
fn chain_holds(bin: &str, chain: &str, mode: HostInMode, pin: &Path) -> bool {
    let rule = rule(mode, pin);
    let mut args = vec!["-w", "5", "-C", chain];
    args.extend(rule.split(' '));
    run(bin, &["-w", "5", "-C", "INPUT", "-j", chain]).is_ok() && run(bin, &args).is_ok()
}

/// Removes every chain of [`HOST_IN_CHAIN_PREFIX`] whose program pin is
/// gone (its pin directory was removed: an older layout, a crashed test),
/// in both families; the chains removed.
pub fn remove_stale_host_in_chains() -> Vec<String> {
    let mut removed = Vec::new();
    for (bin, _) in BINS {
        let Ok(out) = Command::new(bin).args(["-w", "5", "-S"]).output() else {
            continue;
        };
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        for chain in text
            .lines()
            .filter_map(|l| l.strip_prefix("-N "))
            .filter(|c| c.starts_with(HOST_IN_CHAIN_PREFIX))
        {
            let prefix = format!("-A {chain} ");
            let pins: Vec<&str> = text
                .lines()
                .filter(|l| l.starts_with(&prefix))
                .filter_map(|l| l.split("--object-pinned ").nth(1)?.split(' ').next())
                .collect();
            if pins.iter().all(|p| !Path::new(p).exists()) {
                remove_host_in_rules(chain);
                if !removed.iter().any(|c| c == chain) {
                    removed.push(chain.to_string());
                }
            }
        }
    }
    removed
}

/// Removes `chain` and `INPUT`'s jumps to it from iptables and ip6tables;
/// what is not there is no error.
pub fn remove_host_in_rules(chain: &str) {
    for (bin, _) in BINS {
        while run(bin, &["-w", "5", "-D", "INPUT", "-j", chain]).is_ok() {}
        let _ = run(bin, &["-w", "5", "-F", chain]);
        let _ = run(bin, &["-w", "5", "-X", chain]);
    }
}

impl HostIn {
    /// Loads `host_in` from `object` (`None`: the loader's search) with the
    /// maps pinned under `pin_dir`, pins it at [`host_in_pin`] (replacing an
    /// earlier run's pin) and writes the rules of `chain` (the agent's:
    /// [`host_in_chain`] of `pin_dir`; the match, or the drop-all
    /// fallback, see the module doc), after removing the stale chains of
    /// other pin directories ([`remove_stale_host_in_chains`]). Fails only
    /// when neither could be written.
    pub fn open(object: Option<&Path>, pin_dir: &Path, chain: &str) -> Result<Self, EbpfError> {
        for c in remove_stale_host_in_chains() {
            tracing::info!(chain = %c, "host_in: removed the INPUT chain of a pin directory that is gone");
        }
        let load = |switches| -> Result<Ebpf, EbpfError> {
            let mut bpf = load_beside_pins(object, pin_dir, switches)?;
            let prog: &mut SocketFilter = bpf
                .program_mut(PROG_HOST_IN)
                .ok_or(EbpfError::ProgramMissing { program: PROG_HOST_IN })?
                .try_into()
                .map_err(prog_err(PROG_HOST_IN, "not a socket filter"))?;
            prog.load().map_err(prog_err(PROG_HOST_IN, "load (verifier)"))?;
            Ok(bpf)
        };
        // As the pod programs: without the precomputed layers where the
        // verifier refuses the full program.
        let (mut bpf, _) = load_or_reduced(Programs::HostIn, BenchSwitches::default(), load)?;
        let prog: &mut SocketFilter = bpf
            .program_mut(PROG_HOST_IN)
            .ok_or(EbpfError::ProgramMissing { program: PROG_HOST_IN })?
            .try_into()
            .map_err(prog_err(PROG_HOST_IN, "not a socket filter"))?;
        let pin = host_in_pin(pin_dir);
        // The rules hold the program they were written with: a new pin
        // takes effect when the chain is written again below.
        if pin.exists() {
            std::fs::remove_file(&pin).map_err(|source| EbpfError::PinDir {
                path: pin.clone(),
                op: "remove the old host_in pin",
                source,
            })?;
        }
        prog.pin(&pin).map_err(|e| EbpfError::PinDir {
            path: pin.clone(),
            op: "pin host_in",
            source: std::io::Error::other(e.to_string()),
        })?;
        let mut hi = HostIn {
            _bpf: bpf,
            pin,
            chain: chain.to_string(),
            mode: HostInMode::Decided,
        };
        hi.write()?;
        Ok(hi)
    }

    /// Writes the chain in both families: the match, or the drop-all
    /// fallback where the match is refused.
    fn write(&mut self) -> Result<(), EbpfError> {
        let mut mode = HostInMode::Decided;
        for (bin, restore_bin) in BINS {
            if let Err(e) = write_chain(bin, restore_bin, &self.chain, mode, &self.pin) {
                tracing::error!(error = %e, "host_in: the xt_bpf match was refused; deferred Service flows to this node's host network are dropped");
                mode = HostInMode::DropAll;
                break;
            }
        }
        if mode == HostInMode::DropAll {
            for (bin, restore_bin) in BINS {
                write_chain(bin, restore_bin, &self.chain, mode, &self.pin)?;
            }
        }
        self.mode = mode;
        Ok(())
    }

    /// What the rules do with a deferred packet.
    pub fn mode(&self) -> HostInMode {
        self.mode
    }

    /// The chain of the rules.
    pub fn chain(&self) -> &str {
        &self.chain
    }

    /// Writes the rules again where another program removed or changed
    /// them (checked in both families); whether they had to be written.
    pub fn ensure(&mut self) -> Result<bool, EbpfError> {
        if BINS
            .iter()
            .all(|(bin, _)| chain_holds(bin, &self.chain, self.mode, &self.pin))
        {
            return Ok(false);
        }
        tracing::warn!(chain = %self.chain, "host_in: the INPUT rules were changed by another program; writing them again");
        self.write()?;
        Ok(true)
    }

    /// Removes the rules and the program's pin.
    pub fn remove(self) {
        remove_host_in_rules(&self.chain);
        let _ = std::fs::remove_file(&self.pin);
    }
}
