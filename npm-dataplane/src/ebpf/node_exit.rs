//! The `node_exit` programs on the node's interfaces towards other nodes
//! ([`NodeExit`]): the deferred egress decision of Service traffic whose
//! backend kube-proxy chose beyond this node (see `npm_common::service`).
//!
//! [`NodeExit::open`] loads the object with every map of
//! `npm_common::maps::ALL` adopted from the pin directory (the maps the
//! endpoint programs use; the loader of [`super::EbpfDataplane`] pinned
//! them) and puts only `node_exit` and `node_exit_l3` through the
//! verifier. Each interface gets the program of its link type
//! ([`exit_program`]): `node_exit` where the packet starts at an Ethernet
//! header, `node_exit_l3` on a device without one (IPIP, WireGuard, GRE,
//! TUN: the inner packet, before the encapsulation).
//!
//! Two attach modes, as for the endpoints ([`AttachMode`]):
//! - **tcx** (Linux 6.6): a tcx link on the interface's *egress* hook,
//!   first in the chain, pinned as `<pin dir>/exit/<ifindex>`; on open
//!   every pinned one is adopted and its program replaced atomically
//!   (`BPF_LINK_UPDATE`);
//! - **tc** (kernels without tcx): a direct-action `bpf` filter on the
//!   `clsact` egress hook at npm's priority and handle, named by its
//!   program; on open the filters of this pin directory (found by a
//!   netlink dump: npm's priority and handle, a `node_exit*` name, a
//!   program using this pin directory's maps) get the new program in place.
//!
//! [`NodeExit::set_interfaces`] makes the attached set equal to the wanted
//! one (attach first, then detach). The program's first test is the
//! deferral bit of the mark: a packet without it passes untouched, so a wrong
//! choice of interface costs one load and one compare per packet, never a
//! verdict.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use aya::programs::links::{FdLink, Link, PinnedLink};
use aya::programs::tc::{self, SchedClassifierLink, TcAttachOptions, TcError};
use aya::programs::{LinkOrder, ProgramError, TcAttachType};
use aya::Ebpf;

use super::errors::{link_err, prog_err, EbpfError};
use super::features::tcx_supported;
use super::links::{ifname, netlink_errno, nl_options, AttachMode};
use super::loader::{load_beside_pins, load_or_reduced, load_retrying, prog_mut, BenchSwitches, Programs};
use super::tc_filters::{self, list_filters, tc_handle, TC_HANDLE, TC_PRIORITY};
use super::{PROG_NODE_EXIT, PROG_NODE_EXIT_L3};

/// `<pin_dir>/exit`: where the node-exit links are pinned.
pub fn exit_dir(pin_dir: &Path) -> PathBuf {
    pin_dir.join("exit")
}

/// `ARPHRD_ETHER`: the link type of devices whose packets start at an
/// Ethernet header at tc (Ethernet, veth, bridge, VXLAN, macvlan, ...).
const ARPHRD_ETHER: u32 = 1;

/// The program for interface `name`: [`PROG_NODE_EXIT`] on an Ethernet
/// device, [`PROG_NODE_EXIT_L3`] on any other (its link type read from
/// `/sys/class/net/<name>/type`; unreadable: Ethernet, the old choice).
pub fn exit_program(name: &str) -> &'static str {
    let ty = std::fs::read_to_string(format!("/sys/class/net/{name}/type"))
        .ok()
        .and_then(|t| t.trim().parse::<u32>().ok());
    match ty {
        Some(t) if t != ARPHRD_ETHER => PROG_NODE_EXIT_L3,
        _ => PROG_NODE_EXIT,
    }
}

/// One attached interface.
#[derive(Debug)]
enum ExitHook {
    /// A pinned tcx link.
    Tcx(FdLink),
    /// npm's `bpf` filter on the `clsact` egress hook.
    Tc,
}

/// The `node_exit` programs loaded beside the pinned maps, and their
/// attachments.
pub struct NodeExit {
    bpf: Ebpf,
    pin_dir: PathBuf,
    mode: AttachMode,
    /// ifindex -> its hook and the program on it.
    links: BTreeMap<u32, (ExitHook, &'static str)>,
}

impl std::fmt::Debug for NodeExit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeExit")
            .field("pin_dir", &self.pin_dir)
            .field("mode", &self.mode)
            .field(
                "links",
                &self.links.iter().map(|(i, (_, p))| (i, p)).collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// The node-exit filters on every interface's egress hook (npm's
/// priority and handle, a `node_exit*` name): ifindex -> program id.
fn exit_filters() -> Result<BTreeMap<u32, u32>, EbpfError> {
    let netlink = |op: &'static str| move |source| EbpfError::Netlink { op, source };
    let mut out = BTreeMap::new();
    for (ifindex, _) in tc_filters::interfaces().map_err(netlink("list interfaces"))? {
        for f in list_filters(ifindex, TcAttachType::Egress).map_err(netlink("dump tc filters"))? {
            if f.priority == TC_PRIORITY
                && f.handle == TC_HANDLE
                && (f.name == PROG_NODE_EXIT || f.name == PROG_NODE_EXIT_L3)
            {
                out.insert(ifindex, f.prog_id);
            }
        }
    }
    Ok(out)
}

/// The node-exit filters of the pin directory `pin_dir` (whose programs
/// use its maps): their ifindexes.
fn exit_filters_of(pin_dir: &Path) -> Result<BTreeSet<u32>, EbpfError> {
    let owner = match tc_filters::owner_map_id(pin_dir) {
        Ok(o) => o,
        Err(EbpfError::NotPinned { .. }) => return Ok(BTreeSet::new()),
        Err(e) => return Err(e),
    };
    let found = exit_filters()?.into_iter().map(|(i, p)| ((i, 0u8), p)).collect();
    Ok(tc_filters::owned_among(found, owner)
        .into_keys()
        .map(|(i, _)| i)
        .collect())
}

/// Deletes npm's node-exit filter on `ifindex`; gone already is no error.
fn delete_exit_filter(ifindex: u32) -> Result<(), EbpfError> {
    let Ok(name) = ifname(ifindex) else {
        return Ok(());
    };
    let Ok(link) = SchedClassifierLink::attached(&name, TcAttachType::Egress, TC_PRIORITY, tc_handle(), None) else {
        return Ok(());
    };
    match link.detach() {
        Ok(()) => Ok(()),
        Err(e) if matches!(netlink_errno(&e), Some(libc::ENOENT | libc::ENODEV | libc::EINVAL)) => Ok(()),
        Err(e) => Err(prog_err(
            PROG_NODE_EXIT,
            format!("delete tc filter on {name} ({ifindex})"),
        )(e)),
    }
}

impl NodeExit {
    /// [`NodeExit::open_in`] with [`AttachMode::Auto`].
    pub fn open(object: Option<&Path>, pin_dir: &Path) -> Result<Self, EbpfError> {
        Self::open_in(object, pin_dir, AttachMode::Auto)
    }

    /// Loads `node_exit` and `node_exit_l3` from `object` (`None`: the
    /// loader's search) with the maps pinned under `pin_dir`, and adopts
    /// what an earlier agent attached (pinned tcx links under
    /// `<pin_dir>/exit`, and this pin directory's tc filters: their program
    /// replaced atomically); pins of interfaces gone are removed. `mode`
    /// `Auto` is tcx where the kernel has it, else tc.
    pub fn open_in(object: Option<&Path>, pin_dir: &Path, mode: AttachMode) -> Result<Self, EbpfError> {
        let mode = match mode {
            AttachMode::Auto if tcx_supported() => AttachMode::Tcx,
            AttachMode::Auto => AttachMode::Tc,
            m => m,
        };
        let load = |switches| -> Result<Ebpf, EbpfError> {
            let mut bpf = load_beside_pins(object, pin_dir, switches)?;
            for p in [PROG_NODE_EXIT, PROG_NODE_EXIT_L3] {
                load_retrying(prog_mut(&mut bpf, p)?).map_err(prog_err(p, "load (verifier)"))?;
            }
            Ok(bpf)
        };
        // As the pod programs: without the precomputed layers where the
        // verifier refuses the full program.
        let (bpf, _) = load_or_reduced(Programs::NodeExit, BenchSwitches::default(), load)?;
        let dir = exit_dir(pin_dir);
        std::fs::create_dir_all(&dir).map_err(|source| EbpfError::PinDir {
            path: dir.clone(),
            op: "create",
            source,
        })?;
        let mut ne = NodeExit {
            bpf,
            pin_dir: pin_dir.to_path_buf(),
            mode,
            links: BTreeMap::new(),
        };
        ne.adopt()?;
        ne.adopt_filters()?;
        Ok(ne)
    }

    /// Adopts the pinned links (see [`NodeExit::open_in`]).
    fn adopt(&mut self) -> Result<(), EbpfError> {
        for (ifindex, path) in pinned(&self.pin_dir)? {
            let fd: FdLink = match PinnedLink::from_pin(&path) {
                Ok(p) => p.into(),
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "unpinning unreadable node-exit link");
                    let _ = std::fs::remove_file(&path);
                    continue;
                }
            };
            let Ok(name) = ifname(ifindex) else {
                tracing::warn!(path = %path.display(), "unpinning the node-exit link of an interface gone");
                let _ = std::fs::remove_file(&path);
                continue;
            };
            let pname = exit_program(&name);
            let link = SchedClassifierLink::try_from(fd).map_err(link_err(&path, "not a tcx link"))?;
            let prog = prog_mut(&mut self.bpf, pname)?;
            match prog.attach_to_link(link) {
                Ok(id) => {
                    let link = prog.take_link(id).map_err(prog_err(pname, "take adopted link"))?;
                    let fd = FdLink::try_from(link).map_err(link_err(&path, "adopted link"))?;
                    self.links.insert(ifindex, (ExitHook::Tcx(fd), pname));
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "unpinning defunct node-exit link");
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        Ok(())
    }

    /// Adopts this pin directory's node-exit tc filters (see
    /// [`NodeExit::open_in`]); one on an interface that also has a tcx
    /// link (a mode change) is deleted.
    fn adopt_filters(&mut self) -> Result<(), EbpfError> {
        for ifindex in exit_filters_of(&self.pin_dir)? {
            if self.links.contains_key(&ifindex) {
                delete_exit_filter(ifindex)?;
                continue;
            }
            let Ok(name) = ifname(ifindex) else { continue };
            let pname = exit_program(&name);
            match self.replace_filter(&name, pname) {
                Ok(()) => {
                    self.links.insert(ifindex, (ExitHook::Tc, pname));
                }
                Err(e) => tracing::warn!(interface = name, error = %e, "adopting a node-exit tc filter"),
            }
        }
        Ok(())
    }

    /// Replaces the program of npm's node-exit filter on `name` with
    /// `pname` (an atomic program swap in `cls_bpf`).
    fn replace_filter(&mut self, name: &str, pname: &'static str) -> Result<(), EbpfError> {
        let link = SchedClassifierLink::attached(name, TcAttachType::Egress, TC_PRIORITY, tc_handle(), None).map_err(
            |source| EbpfError::Netlink {
                op: "resolve interface of a tc filter",
                source,
            },
        )?;
        let prog = prog_mut(&mut self.bpf, pname)?;
        let id = prog
            .attach_to_link(link)
            .map_err(prog_err(pname, format!("tc filter replace on {name}")))?;
        std::mem::forget(prog.take_link(id).map_err(prog_err(pname, "take tc link"))?);
        Ok(())
    }

    /// The interfaces a `node_exit` program is on.
    pub fn attached(&self) -> BTreeSet<u32> {
        self.links.keys().copied().collect()
    }

    /// The program on `ifindex`, if attached.
    pub fn program_on(&self, ifindex: u32) -> Option<&'static str> {
        self.links.get(&ifindex).map(|(_, p)| *p)
    }

    /// The attach mode in use (tcx or tc; never `Auto`).
    pub fn mode(&self) -> AttachMode {
        self.mode
    }

    /// Makes a `node_exit` program attached to exactly `wanted`
    /// (ifindexes): attaches the missing ones, then detaches the others. An
    /// interface that cannot be attached is reported after the others were
    /// handled.
    pub fn set_interfaces(&mut self, wanted: &BTreeSet<u32>) -> Result<(), EbpfError> {
        let mut first_err = None;
        for &ifindex in wanted {
            if self.links.contains_key(&ifindex) {
                continue;
            }
            match self.attach(ifindex) {
                Ok(hook) => {
                    self.links.insert(ifindex, hook);
                }
                Err(e) => {
                    tracing::warn!(ifindex, error = %e, "attaching node_exit");
                    first_err.get_or_insert(e);
                }
            }
        }
        let stale: Vec<u32> = self.links.keys().filter(|i| !wanted.contains(i)).copied().collect();
        for ifindex in stale {
            if let Err(e) = self.detach(ifindex) {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Attaches the program of `ifindex`'s link type to its egress hook:
    /// a pinned tcx link first in the chain, or npm's tc filter.
    fn attach(&mut self, ifindex: u32) -> Result<(ExitHook, &'static str), EbpfError> {
        let name = ifname(ifindex)?;
        let pname = exit_program(&name);
        let hook = if self.mode == AttachMode::Tc {
            match tc::qdisc_add_clsact(&name) {
                Ok(()) => {}
                Err(TcError::NetlinkError(e)) if e.raw_os_error() == Some(libc::EEXIST) => {}
                Err(e) => {
                    return Err(prog_err(pname, format!("add clsact qdisc to {name} ({ifindex})"))(
                        ProgramError::TcError(e),
                    ))
                }
            }
            let prog = prog_mut(&mut self.bpf, pname)?;
            match prog.attach_with_options(&name, TcAttachType::Egress, nl_options()) {
                Ok(id) => std::mem::forget(prog.take_link(id).map_err(prog_err(pname, "take tc link"))?),
                // Another pin directory's filter (an older layout): its
                // program is replaced in place.
                Err(e) if netlink_errno(&e) == Some(libc::EEXIST) => self.replace_filter(&name, pname)?,
                Err(e) => return Err(prog_err(pname, format!("tc attach to {name} ({ifindex})"))(e)),
            }
            ExitHook::Tc
        } else {
            let path = exit_dir(&self.pin_dir).join(ifindex.to_string());
            let prog = prog_mut(&mut self.bpf, pname)?;
            let id = prog
                .attach_with_options(
                    &name,
                    TcAttachType::Egress,
                    TcAttachOptions::TcxOrder(LinkOrder::first()),
                )
                .map_err(prog_err(pname, format!("tcx attach to {name} ({ifindex})")))?;
            let link = prog.take_link(id).map_err(prog_err(pname, "take link"))?;
            ExitHook::Tcx(super::links::pin_tcx_link(link, &path)?)
        };
        tracing::info!(interface = name, ifindex, program = pname, mode = %self.mode, "node_exit attached");
        Ok((hook, pname))
    }

    /// Detaches `node_exit` from `ifindex` (unpins and closes its link, or
    /// deletes its filter).
    pub fn detach(&mut self, ifindex: u32) -> Result<(), EbpfError> {
        match self.links.remove(&ifindex) {
            Some((ExitHook::Tcx(link), _)) => {
                super::links::unpin_link(exit_dir(&self.pin_dir).join(ifindex.to_string()))?;
                drop(link);
            }
            Some((ExitHook::Tc, _)) => delete_exit_filter(ifindex)?,
            None => {}
        }
        Ok(())
    }
}

/// The (ifindex, path) of every link pinned under `<pin_dir>/exit`
/// (files of other names are ignored). An absent directory has none.
fn pinned(pin_dir: &Path) -> Result<Vec<(u32, PathBuf)>, EbpfError> {
    let dir = exit_dir(pin_dir);
    let rd = match std::fs::read_dir(&dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(EbpfError::PinDir {
                path: dir,
                op: "read",
                source,
            })
        }
    };
    Ok(rd
        .flatten()
        .filter_map(|e| Some((e.file_name().to_str()?.parse().ok()?, e.path())))
        .collect())
}

/// Removes every node-exit link pinned under `<pin_dir>/exit` and every
/// node-exit tc filter of the pin directory ([`remove_node_exit_filters`];
/// a link no process holds is detached when its pin goes). Returns the
/// ifindexes cleared.
pub fn remove_node_exit_pins(pin_dir: &Path) -> Result<Vec<u32>, EbpfError> {
    let mut out = Vec::new();
    for (ifindex, path) in pinned(pin_dir)? {
        match std::fs::remove_file(&path) {
            Ok(()) => out.push(ifindex),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(EbpfError::Unpin { path, source }),
        }
    }
    out.extend(remove_node_exit_filters(pin_dir)?);
    let _ = std::fs::remove_dir(exit_dir(pin_dir));
    Ok(out)
}

/// Deletes every node-exit tc filter of the pin directory `pin_dir` (its
/// maps must still be pinned: a filter's owner is told by their ids), for
/// `npm-agent cleanup`. Returns their ifindexes.
pub fn remove_node_exit_filters(pin_dir: &Path) -> Result<Vec<u32>, EbpfError> {
    let mut out = Vec::new();
    for ifindex in exit_filters_of(pin_dir)? {
        delete_exit_filter(ifindex)?;
        out.push(ifindex);
    }
    Ok(out)
}
