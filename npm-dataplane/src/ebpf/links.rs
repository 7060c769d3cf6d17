//! The tcx links on each endpoint's host-side veth: `npm_ingress` on the
//! tcx *egress* hook (packets entering the pod) and `npm_egress` on the tcx
//! *ingress* hook (packets leaving the pod), first in the tcx chain, each
//! pinned at [`pins::link_path`]. On open every pinned link is adopted and
//! its program replaced atomically (`BPF_LINK_UPDATE`); attach, detach and
//! the set of attached interfaces.

use std::collections::BTreeSet;

use aya::programs::links::{FdLink, PinnedLink};
use aya::programs::tc::{SchedClassifierLink, TcAttachOptions};
use aya::programs::{LinkOrder, TcAttachType};
use npm_common::{DIR_EGRESS, DIR_INGRESS};

use super::errors::{link_err, prog_err, EbpfError};
use super::loader::prog_mut;
use super::pins::{self, link_pins};
use super::{EbpfDataplane, PROG_EGRESS, PROG_INGRESS};

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
                    self.links.insert((ifindex, d), fd);
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

    /// Attaches both programs to the host-side interface `ifindex` with tcx
    /// (first in the tcx chain) and pins the links. Already attached hooks
    /// are left alone.
    pub fn attach(&mut self, ifindex: u32) -> Result<(), EbpfError> {
        for d in [DIR_INGRESS, DIR_EGRESS] {
            if self.links.contains_key(&(ifindex, d)) {
                continue;
            }
            let name = ifname(ifindex)?;
            let path = pins::link_path(&self.pin_dir, ifindex, d);
            let hook = if d == DIR_INGRESS {
                TcAttachType::Egress
            } else {
                TcAttachType::Ingress
            };
            let pname = prog_for(d);
            let prog = prog_mut(&mut self.bpf, pname)?;
            let id = prog
                .attach_with_options(&name, hook, TcAttachOptions::TcxOrder(LinkOrder::first()))
                .map_err(prog_err(pname, format!("tcx attach to {name} ({ifindex})")))?;
            let link = prog.take_link(id).map_err(prog_err(pname, "take link"))?;
            let fd = FdLink::try_from(link).map_err(link_err(&path, "not an fd link"))?;
            // A stale pin (interface recreated with the same ifindex) is replaced.
            let _ = std::fs::remove_file(&path);
            let pinned = fd.pin(&path).map_err(|source| EbpfError::PinLink {
                path: path.clone(),
                source: Box::new(source),
            })?;
            self.links.insert((ifindex, d), FdLink::from(pinned));
        }
        Ok(())
    }

    /// Detaches both programs from `ifindex` (unpins and closes the links).
    pub fn detach(&mut self, ifindex: u32) -> Result<(), EbpfError> {
        for d in [DIR_INGRESS, DIR_EGRESS] {
            let path = pins::link_path(&self.pin_dir, ifindex, d);
            if let Some(link) = self.links.remove(&(ifindex, d)) {
                match std::fs::remove_file(&path) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(source) => return Err(EbpfError::Unpin { path, source }),
                }
                drop(link);
            }
        }
        Ok(())
    }

    /// The interfaces with at least one attached hook.
    pub fn attached(&self) -> BTreeSet<u32> {
        self.links.keys().map(|(i, _)| *i).collect()
    }
}
