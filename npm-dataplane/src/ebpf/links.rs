//! The programs on each endpoint's host-side veth, in one of two modes
//! ([`AttachMode`]): `npm_ingress` on the *egress* hook (packets entering
//! the pod) and `npm_egress` on the *ingress* hook (packets leaving it).
//!
//! - **tcx** (Linux 6.6): a tcx link first in the chain, pinned at
//!   [`pins::link_path`]; on open every pinned link is adopted and its
//!   program replaced atomically (`BPF_LINK_UPDATE`).
//! - **tc**: a `clsact` qdisc and a direct-action `bpf` filter at npm's
//!   priority and handle ([`super::tc_filters`]). Filters cannot be pinned:
//!   on open the filters of this pin directory are found by a netlink dump
//!   (npm's priority, handle and name, a program using this pin
//!   directory's maps) and their program replaced in place (`RTM_NEWTFILTER`
//!   on the same priority and handle without `NLM_F_EXCL`: `cls_bpf`
//!   swaps the program with an RCU replace, no packet sees no filter).
//!
//! A node never mixes modes: `auto` keeps the mode an earlier agent left
//! (tcx links pinned, or npm filters found), else probes tcx. A hook found
//! in the other mode (a forced mode change) keeps enforcing with the new
//! program until this mode is attached there; then the other goes.
//! Attach, detach and the set of attached interfaces.

use std::collections::BTreeSet;
use std::fmt;
use std::str::FromStr;

use aya::programs::links::{FdLink, Link, PinnedLink};
use aya::programs::tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions, TcError};
use aya::programs::{LinkOrder, ProgramError};
use npm_common::{DIR_EGRESS, DIR_INGRESS};

use super::errors::{link_err, prog_err, EbpfError};
use super::loader::prog_mut;
use super::pins::{self, link_pins};
use super::tc_filters::{self, hook_of, tc_handle, TC_PRIORITY};
use super::{EbpfDataplane, PROG_EGRESS, PROG_INGRESS};

/// How the programs are attached (`--attach`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum AttachMode {
    /// tcx where the kernel has it, else tc; the mode an earlier agent
    /// left on this node is kept.
    #[default]
    Auto,
    /// tcx links (Linux 6.6 or later).
    Tcx,
    /// A `clsact` qdisc and netlink `bpf` filters.
    Tc,
}

impl fmt::Display for AttachMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AttachMode::Auto => "auto",
            AttachMode::Tcx => "tcx",
            AttachMode::Tc => "tc",
        })
    }
}

impl FromStr for AttachMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(AttachMode::Auto),
            "tcx" => Ok(AttachMode::Tcx),
            "tc" => Ok(AttachMode::Tc),
            other => Err(format!("unknown attach mode {other:?} (auto, tcx or tc)")),
        }
    }
}

/// One attached hook.
#[derive(Debug)]
pub(crate) enum Hook {
    /// A tcx link (pinned under `links/`).
    Tcx(FdLink),
    /// npm's `bpf` filter on the `clsact` hook.
    Tc,
}

impl Hook {
    /// The mode of this hook.
    fn mode(&self) -> AttachMode {
        match self {
            Hook::Tcx(_) => AttachMode::Tcx,
            Hook::Tc => AttachMode::Tc,
        }
    }
}

/// The name of interface `ifindex`.
pub(crate) fn ifname(ifindex: u32) -> Result<String, EbpfError> {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: the buffer has IF_NAMESIZE bytes.
    let p = unsafe { libc::if_indextoname(ifindex, buf.as_mut_ptr()) };
    if p.is_null() {
        return Err(EbpfError::Interface {
            ifindex,
            source: std::io::Error::last_os_error(),
        });
    }
    // SAFETY: if_indextoname wrote a NUL-terminated name.
    let name = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
    Ok(name.to_string_lossy().into_owned())
}

/// `"ingress"` or `"egress"`: the pod direction `dir` in pin names and dumps.
pub(crate) fn dir_name(dir: u8) -> &'static str {
    if dir == DIR_INGRESS {
        "ingress"
    } else {
        "egress"
    }
}

/// The program of pod direction `dir`.
pub(crate) fn prog_for(dir: u8) -> &'static str {
    if dir == DIR_INGRESS {
        PROG_INGRESS
    } else {
        PROG_EGRESS
    }
}

/// npm's netlink options: its fixed priority and handle.
pub(crate) fn nl_options() -> TcAttachOptions {
    TcAttachOptions::Netlink(NlOptions {
        priority: TC_PRIORITY,
        handle: tc_handle(),
        classid: None,
    })
}

/// The errno of a netlink failure under a program error.
pub(crate) fn netlink_errno(e: &ProgramError) -> Option<i32> {
    match e {
        ProgramError::TcError(TcError::NetlinkError(n)) | ProgramError::NetlinkError(n) => n.raw_os_error(),
        _ => None,
    }
}

/// aya detaches a netlink filter when the handle it returns is dropped;
/// npm's filters must outlive the loader, as pinned tcx links do. The
/// handle holds no file descriptor (only ifindex, hook, priority and
/// handle), so forgetting it leaks nothing; detaching goes by npm's fixed
/// priority and handle ([`EbpfDataplane::detach`]).
fn keep_attached(link: SchedClassifierLink) {
    std::mem::forget(link);
}

impl EbpfDataplane {
    /// Adopts the links pinned under `links/`: each gets the newly loaded
    /// program with an atomic link update. Links whose interface is gone
    /// are unpinned.
    pub(crate) fn adopt_links(&mut self) -> Result<(), EbpfError> {
        let found = link_pins(&self.pin_dir).map_err(|source| EbpfError::PinDir {
            path: self.pin_dir.join("links"),
            op: "read",
            source,
        })?;
        let mut hooks = Vec::new();
        for (hook, path) in found {
            match hook {
                Some(k) => hooks.push((k, path)),
                None => tracing::warn!(path = %path.display(), "ignoring unknown file in links directory"),
            }
        }
        for ((ifindex, d), path) in hooks {
            let pinned = match PinnedLink::from_pin(&path) {
                Ok(p) => p,
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "unpinning unreadable link");
                    let _ = std::fs::remove_file(&path);
                    continue;
                }
            };
            let fd: FdLink = pinned.into();
            let link = SchedClassifierLink::try_from(fd).map_err(link_err(&path, "not a tcx link"))?;
            let name = prog_for(d);
            let prog = prog_mut(&mut self.bpf, name)?;
            match prog.attach_to_link(link) {
                Ok(id) => {
                    let link = prog.take_link(id).map_err(prog_err(name, "take adopted link"))?;
                    let fd = FdLink::try_from(link).map_err(link_err(&path, "adopted link"))?;
                    self.links.insert((ifindex, d), Hook::Tcx(fd));
                }
                Err(e) => {
                    // The interface went away: the link is defunct.
                    tracing::warn!(path = %path.display(), error = %e, "unpinning defunct link");
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        Ok(())
    }

    /// Adopts npm's tc filters of this pin directory (found by a netlink
    /// dump): each gets the newly loaded program, replaced in place at the
    /// same priority and handle. A hook that also has a tcx link (a mode
    /// change interrupted) keeps the link and the filter; the one of the
    /// mode chosen goes when [`EbpfDataplane::attach`] reaches the hook.
    /// Returns whether npm filters of any pin directory are on this node.
    pub(crate) fn adopt_filters(&mut self) -> Result<bool, EbpfError> {
        let owner = tc_filters::owner_map_id(&self.pin_dir)?;
        let found = tc_filters::npm_filters()?;
        let any = !found.is_empty();
        for (ifindex, d) in tc_filters::owned_among(found, owner).into_keys() {
            let Ok(name) = ifname(ifindex) else { continue };
            if let Err(e) = self.replace_filter(&name, d) {
                // Gone since the dump, or refused: the filter keeps its
                // program until `attach` reaches the hook (and replaces it
                // there, or reports why not).
                tracing::warn!(interface = name, direction = dir_name(d), error = %e, "adopting an npm tc filter");
                continue;
            }
            if let Some(Hook::Tcx(_)) = self.links.get(&(ifindex, d)) {
                self.doubled.insert((ifindex, d));
            } else {
                self.links.insert((ifindex, d), Hook::Tc);
            }
        }
        Ok(any)
    }

    /// Replaces the program of npm's filter of pod direction `d` on
    /// interface `name` (`RTM_NEWTFILTER` on npm's priority and handle,
    /// without `NLM_F_CREATE`/`NLM_F_EXCL`: an atomic program swap in
    /// `cls_bpf`; `ENOENT` when there is no such filter).
    fn replace_filter(&mut self, name: &str, d: u8) -> Result<(), EbpfError> {
        let pname = prog_for(d);
        let link =
            SchedClassifierLink::attached(name, hook_of(d), TC_PRIORITY, tc_handle(), None).map_err(|source| {
                EbpfError::Netlink {
                    op: "resolve interface of a tc filter",
                    source,
                }
            })?;
        let prog = prog_mut(&mut self.bpf, pname)?;
        let id = prog
            .attach_to_link(link)
            .map_err(prog_err(pname, format!("tc filter replace on {name}")))?;
        keep_attached(prog.take_link(id).map_err(prog_err(pname, "take tc link"))?);
        Ok(())
    }

    /// Attaches `npm`'s filter of pod direction `d` to interface `name`:
    /// adds the `clsact` qdisc unless there is one, creates the filter at
    /// npm's priority and handle, or, when one is there already (another
    /// map layout's npm filter), replaces its program in place.
    fn attach_tc(&mut self, name: &str, ifindex: u32, d: u8) -> Result<(), EbpfError> {
        match tc::qdisc_add_clsact(name) {
            Ok(()) => {}
            Err(TcError::NetlinkError(e)) if e.raw_os_error() == Some(libc::EEXIST) => {}
            Err(e) => {
                return Err(
                    prog_err(prog_for(d), format!("add clsact qdisc to {name} ({ifindex})"))(ProgramError::TcError(e)),
                )
            }
        }
        let pname = prog_for(d);
        let prog = prog_mut(&mut self.bpf, pname)?;
        match prog.attach_with_options(name, hook_of(d), nl_options()) {
            Ok(id) => {
                keep_attached(prog.take_link(id).map_err(prog_err(pname, "take tc link"))?);
                Ok(())
            }
            Err(e) if netlink_errno(&e) == Some(libc::EEXIST) => {
                tracing::info!(
                    interface = name,
                    program = pname,
                    "replacing the program of an existing npm tc filter"
                );
                self.replace_filter(name, d)
            }
            Err(e) => Err(prog_err(pname, format!("tc attach to {name} ({ifindex})"))(e)),
        }
    }

    /// Attaches the tcx link of pod direction `d` to interface `name`
    /// (first in the tcx chain) and pins it.
    fn attach_tcx(&mut self, name: &str, ifindex: u32, d: u8) -> Result<FdLink, EbpfError> {
        let path = pins::link_path(&self.pin_dir, ifindex, d);
        let pname = prog_for(d);
        let prog = prog_mut(&mut self.bpf, pname)?;
        let id = prog
            .attach_with_options(name, hook_of(d), TcAttachOptions::TcxOrder(LinkOrder::first()))
            .map_err(prog_err(pname, format!("tcx attach to {name} ({ifindex})")))?;
        let link = prog.take_link(id).map_err(prog_err(pname, "take link"))?;
        pin_tcx_link(link, &path)
    }

    /// Whether both hooks of `ifindex` are attached in this dataplane's mode.
    pub(crate) fn attached_in_mode(&self, ifindex: u32) -> bool {
        [DIR_INGRESS, DIR_EGRESS].into_iter().all(|d| {
            !self.doubled.contains(&(ifindex, d))
                && self.links.get(&(ifindex, d)).is_some_and(|h| h.mode() == self.mode)
        })
    }

    /// Attaches both programs to the host-side interface `ifindex` in this
    /// dataplane's mode (tcx: first in the tcx chain, links pinned; tc:
    /// npm's filters). Hooks already attached in this mode are left alone;
    /// a hook attached in the other mode gets this mode first, then loses
    /// the other, so it is never without a program.
    pub fn attach(&mut self, ifindex: u32) -> Result<(), EbpfError> {
        for d in [DIR_INGRESS, DIR_EGRESS] {
            let key = (ifindex, d);
            if self.doubled.remove(&key) {
                // A tcx link (in `links`) and npm's filter both run here
                // (adopted with the new program): the other mode's goes.
                if self.mode == AttachMode::Tc {
                    if let Some(old) = self.links.insert(key, Hook::Tc) {
                        self.remove_hook(ifindex, d, old)?;
                    }
                } else {
                    delete_filter(ifindex, d)?;
                }
                continue;
            }
            if self.links.get(&key).map(Hook::mode) == Some(self.mode) {
                continue;
            }
            let name = ifname(ifindex)?;
            let new = if self.mode == AttachMode::Tc {
                self.attach_tc(&name, ifindex, d)?;
                Hook::Tc
            } else {
                Hook::Tcx(self.attach_tcx(&name, ifindex, d)?)
            };
            if let Some(old) = self.links.insert(key, new) {
                tracing::info!(ifindex, direction = dir_name(d), from = %old.mode(), to = %self.mode, "attach mode changed on this hook");
                self.remove_hook(ifindex, d, old)?;
            }
        }
        Ok(())
    }

    /// Removes one hook's attachment: unpins a tcx link, deletes npm's
    /// filter (exactly it: npm's priority and handle; other filters and the
    /// `clsact` qdisc stay).
    fn remove_hook(&mut self, ifindex: u32, d: u8, hook: Hook) -> Result<(), EbpfError> {
        match hook {
            Hook::Tcx(link) => {
                unpin_link(pins::link_path(&self.pin_dir, ifindex, d))?;
                drop(link);
                Ok(())
            }
            Hook::Tc => delete_filter(ifindex, d),
        }
    }

    /// Detaches both programs from `ifindex` (unpins and closes the tcx
    /// links, deletes npm's tc filters).
    pub fn detach(&mut self, ifindex: u32) -> Result<(), EbpfError> {
        for d in [DIR_INGRESS, DIR_EGRESS] {
            if self.doubled.remove(&(ifindex, d)) {
                delete_filter(ifindex, d)?;
            }
            if let Some(hook) = self.links.remove(&(ifindex, d)) {
                self.remove_hook(ifindex, d, hook)?;
            }
        }
        Ok(())
    }

    /// The interfaces with at least one attached hook.
    pub fn attached(&self) -> BTreeSet<u32> {
        self.links.keys().map(|(i, _)| *i).collect()
    }

    /// The attach mode in use (tcx or tc; never `Auto`).
    pub fn attach_mode(&self) -> AttachMode {
        self.mode
    }
}

/// Deletes npm's filter of pod direction `d` on `ifindex` (npm's priority
/// and handle only). A filter or interface already gone is no error.
pub(crate) fn delete_filter(ifindex: u32, d: u8) -> Result<(), EbpfError> {
    let Ok(name) = ifname(ifindex) else {
        return Ok(());
    };
    let Ok(link) = SchedClassifierLink::attached(&name, hook_of(d), TC_PRIORITY, tc_handle(), None) else {
        return Ok(());
    };
    match link.detach() {
        Ok(()) => Ok(()),
        Err(e) if matches!(netlink_errno(&e), Some(libc::ENOENT | libc::ENODEV | libc::EINVAL)) => Ok(()),
        Err(e) => Err(prog_err(prog_for(d), format!("delete tc filter on {name} ({ifindex})"))(e)),
    }
}

/// Deletes every npm tc filter of the pin directory `pin_dir` (npm's
/// priority and handle, a program using the maps pinned there), for
/// `npm-agent cleanup`: tc filters are not pinned, so removing the pin
/// directory alone would leave them attached. Call it before the maps are
/// unpinned (ownership is told by their ids). Other filters and the
/// `clsact` qdiscs stay. Returns the hooks cleared: (ifindex, pod
/// direction `"ingress"`/`"egress"`).
pub fn remove_pinned_filters(pin_dir: &std::path::Path) -> Result<Vec<(u32, &'static str)>, EbpfError> {
    let mut removed = Vec::new();
    for (ifindex, d) in tc_filters::filters_of(pin_dir)?.into_keys() {
        delete_filter(ifindex, d)?;
        removed.push((ifindex, dir_name(d)));
    }
    Ok(removed)
}

/// Pins the tcx `link` at `path` (a stale pin of an interface recreated
/// with the same ifindex is replaced) and returns the pinned link.
pub(crate) fn pin_tcx_link(
    link: aya::programs::tc::SchedClassifierLink,
    path: &std::path::Path,
) -> Result<FdLink, EbpfError> {
    let fd = FdLink::try_from(link).map_err(link_err(path, "not an fd link"))?;
    let _ = std::fs::remove_file(path);
    let pinned = fd.pin(path).map_err(|source| EbpfError::PinLink {
        path: path.to_path_buf(),
        source: Box::new(source),
    })?;
    Ok(FdLink::from(pinned))
}

/// Removes the pin of a link at `path` (an absent pin is fine); the link
/// is detached once its last handle is closed.
pub(crate) fn unpin_link(path: std::path::PathBuf) -> Result<(), EbpfError> {
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(EbpfError::Unpin { path, source }),
    }
}

#[cfg(test)]
mod tests {
    use super::AttachMode;

    #[test]
    fn attach_modes_parse_and_print_as_the_flag_spells_them() {
        for (s, m) in [
            ("auto", AttachMode::Auto),
            ("tcx", AttachMode::Tcx),
            ("tc", AttachMode::Tc),
        ] {
            assert_eq!(s.parse::<AttachMode>(), Ok(m));
            assert_eq!(m.to_string(), s);
        }
        assert!("tcx2".parse::<AttachMode>().unwrap_err().contains("auto, tcx or tc"));
        assert_eq!(AttachMode::default(), AttachMode::Auto);
    }
}
