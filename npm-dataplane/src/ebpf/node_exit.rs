//! The `node_exit` program on the node's interfaces towards other nodes
//! ([`NodeExit`]): the deferred egress decision of Service traffic whose
//! backend kube-proxy chose beyond this node (see `npm_common::service`).
//!
//! [`NodeExit::open`] loads the object with every map of
//! `npm_common::maps::ALL` adopted from the pin directory (the maps the
//! endpoint programs use; the loader of [`super::EbpfDataplane`] pinned
//! them) and puts only `node_exit` through the verifier. Its links are tcx
//! links on the interface's *egress* hook, first in the chain, pinned as
//! `<pin dir>/exit/<ifindex>`; on open every pinned one is adopted and its
//! program replaced atomically (`BPF_LINK_UPDATE`), and
//! [`NodeExit::set_interfaces`] makes the attached set equal to the wanted
//! one (attach first, then detach). The program's first test is the
//! deferral mark: a packet without one passes untouched, so a wrong
//! choice of interface costs one load and one compare per packet, never a
//! verdict. tcx only (Linux 6.6): on a node without tcx the agent leaves
//! `NPM_SERVICES` empty, so nothing is deferred.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use aya::programs::links::{FdLink, PinnedLink};
use aya::programs::tc::{SchedClassifierLink, TcAttachOptions};
use aya::programs::{LinkOrder, TcAttachType};
use aya::{Ebpf, EbpfLoader};
use npm_common::maps;

use super::errors::{link_err, prog_err, EbpfError};
use super::links::ifname;
use super::loader::{load_retrying, prog_mut, read_object};
use super::PROG_NODE_EXIT;

/// `<pin_dir>/exit`: where the node-exit links are pinned.
pub fn exit_dir(pin_dir: &Path) -> PathBuf {
    pin_dir.join("exit")
}

/// The `node_exit` program loaded beside the pinned maps, and its links.
pub struct NodeExit {
    bpf: Ebpf,
    pin_dir: PathBuf,
    /// ifindex -> its pinned tcx link.
    links: BTreeMap<u32, FdLink>,
}

impl std::fmt::Debug for NodeExit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeExit")
            .field("pin_dir", &self.pin_dir)
            .field("links", &self.links.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl NodeExit {
    /// Loads `node_exit` from `object` (`None`: the loader's search) with
    /// the maps pinned under `pin_dir` and adopts the links pinned under
    /// `<pin_dir>/exit` (their program replaced atomically); pins of
    /// interfaces gone are removed.
    pub fn open(object: Option<&Path>, pin_dir: &Path) -> Result<Self, EbpfError> {
        let (object, data) = read_object(object)?;
        let mut loader = EbpfLoader::new();
        for name in maps::ALL {
            loader.map_pin_path(name, pin_dir.join(name));
        }
        let mut bpf = loader.load(&data).map_err(|source| EbpfError::Load {
            path: object.clone(),
            source: Box::new(source),
        })?;
        let prog = prog_mut(&mut bpf, PROG_NODE_EXIT)?;
        load_retrying(prog).map_err(prog_err(PROG_NODE_EXIT, "load (verifier)"))?;
        let dir = exit_dir(pin_dir);
        std::fs::create_dir_all(&dir).map_err(|source| EbpfError::PinDir {
            path: dir.clone(),
            op: "create",
            source,
        })?;
        let mut ne = NodeExit {
            bpf,
            pin_dir: pin_dir.to_path_buf(),
            links: BTreeMap::new(),
        };
        ne.adopt()?;
        Ok(ne)
    }

    /// Adopts the pinned links (see [`NodeExit::open`]).
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
            let link = SchedClassifierLink::try_from(fd).map_err(link_err(&path, "not a tcx link"))?;
            let prog = prog_mut(&mut self.bpf, PROG_NODE_EXIT)?;
            match prog.attach_to_link(link) {
                Ok(id) => {
                    let link = prog
                        .take_link(id)
                        .map_err(prog_err(PROG_NODE_EXIT, "take adopted link"))?;
                    let fd = FdLink::try_from(link).map_err(link_err(&path, "adopted link"))?;
                    self.links.insert(ifindex, fd);
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "unpinning defunct node-exit link");
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        Ok(())
    }

    /// The interfaces `node_exit` is attached to.
    pub fn attached(&self) -> BTreeSet<u32> {
        self.links.keys().copied().collect()
    }

    /// Makes `node_exit` attached to exactly `wanted` (ifindexes): attaches
    /// the missing ones, then detaches the others. An interface that
    /// cannot be attached is reported after the others were handled.
    pub fn set_interfaces(&mut self, wanted: &BTreeSet<u32>) -> Result<(), EbpfError> {
        let mut first_err = None;
        for &ifindex in wanted {
            if self.links.contains_key(&ifindex) {
                continue;
            }
            match self.attach(ifindex) {
                Ok(fd) => {
                    self.links.insert(ifindex, fd);
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

    /// Attaches a tcx link of `node_exit` to the egress hook of `ifindex`
    /// (first in the chain) and pins it.
    fn attach(&mut self, ifindex: u32) -> Result<FdLink, EbpfError> {
        let name = ifname(ifindex)?;
        let path = exit_dir(&self.pin_dir).join(ifindex.to_string());
        let prog = prog_mut(&mut self.bpf, PROG_NODE_EXIT)?;
        let id = prog
            .attach_with_options(
                &name,
                TcAttachType::Egress,
                TcAttachOptions::TcxOrder(LinkOrder::first()),
            )
            .map_err(prog_err(PROG_NODE_EXIT, format!("tcx attach to {name} ({ifindex})")))?;
        let link = prog.take_link(id).map_err(prog_err(PROG_NODE_EXIT, "take link"))?;
        let pinned = super::links::pin_tcx_link(link, &path)?;
        tracing::info!(interface = name, ifindex, "node_exit attached");
        Ok(pinned)
    }

    /// Detaches `node_exit` from `ifindex` (unpins and closes its link).
    pub fn detach(&mut self, ifindex: u32) -> Result<(), EbpfError> {
        if let Some(link) = self.links.remove(&ifindex) {
            super::links::unpin_link(exit_dir(&self.pin_dir).join(ifindex.to_string()))?;
            drop(link);
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

/// Removes every node-exit link pinned under `<pin_dir>/exit` (for
/// `npm-agent cleanup`; a link no process holds is detached when its pin
/// goes). Returns the ifindexes cleared.
pub fn remove_node_exit_pins(pin_dir: &Path) -> Result<Vec<u32>, EbpfError> {
    let mut out = Vec::new();
    for (ifindex, path) in pinned(pin_dir)? {
        match std::fs::remove_file(&path) {
            Ok(()) => out.push(ifindex),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(EbpfError::Unpin { path, source }),
        }
    }
    let _ = std::fs::remove_dir(exit_dir(pin_dir));
    Ok(out)
}
