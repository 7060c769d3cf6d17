//! The tc (`clsact` + netlink `bpf` filter) side of attachment, for kernels
//! without tcx: npm's fixed filter priority and handle ([`TC_PRIORITY`],
//! [`TC_HANDLE`]), a read-only netlink dump of the `bpf` filters on a
//! `clsact` hook (`RTM_GETTFILTER`), and which of them belong to a pin
//! directory: an npm filter (npm's priority, handle and program name) whose
//! program uses the `NPM_EP_SLOTS` map pinned there. Netlink filters cannot
//! be pinned on bpffs; this discovery needs no state of its own, so what
//! the kernel runs is the only record and cannot disagree with it.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::Path;

use aya::maps::MapData;
use aya::programs::tc::TcHandle;
use aya::programs::TcAttachType;
use npm_common::{maps, DIR_EGRESS, DIR_INGRESS};

use super::errors::{map_err, EbpfError};
use super::links::prog_for;

/// Priority of npm's filters on the `clsact` hooks (lowest number runs
/// first: npm decides before other filters, as it is first in the tcx chain).
pub const TC_PRIORITY: u16 = 1;
/// Handle of npm's filters (`0x6e706d`, "npm"): with [`TC_PRIORITY`] it
/// names npm's filter on a hook, so a restarted agent replaces its program
/// in place (`RTM_NEWTFILTER` on the same priority and handle, without
/// `NLM_F_EXCL`) instead of adding a second filter.
pub const TC_HANDLE: u32 = 0x006e_706d;

/// [`TC_HANDLE`] as aya's handle.
pub(crate) fn tc_handle() -> TcHandle {
    TcHandle::from(TC_HANDLE)
}

/// The tc hook of pod direction `dir`: packets entering the pod leave the
/// host-side veth (egress hook), packets leaving it enter there (ingress).
pub(crate) fn hook_of(dir: u8) -> TcAttachType {
    if dir == DIR_INGRESS {
        TcAttachType::Egress
    } else {
        TcAttachType::Ingress
    }
}

/// One `bpf` filter of a `clsact` hook, as the kernel dumps it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TcFilter {
    /// Priority.
    pub priority: u16,
    /// Handle.
    pub handle: u32,
    /// `TCA_BPF_NAME` (the program's name as the loader gave it).
    pub name: String,
    /// `TCA_BPF_ID`: the attached program's id.
    pub prog_id: u32,
    /// Whether the filter runs in direct-action mode.
    pub direct_action: bool,
}

impl TcFilter {
    /// Whether this is npm's filter for pod direction `dir` (npm's
    /// priority, handle and program name).
    pub fn is_npm(&self, dir: u8) -> bool {
        self.priority == TC_PRIORITY && self.handle == TC_HANDLE && self.name == prog_for(dir)
    }
}

const TCA_KIND: u16 = 1;
const TCA_OPTIONS: u16 = 2;
const TCA_BPF_NAME: u16 = 7;
const TCA_BPF_FLAGS: u16 = 8;
const TCA_BPF_ID: u16 = 11;
const TCA_BPF_FLAG_ACT_DIRECT: u32 = 1;
const NLMSG_HDR: usize = 16;
const TCMSG_LEN: usize = 20;

/// The parent of a `clsact` hook (`TC_H_MAKE(TC_H_CLSACT, TC_H_MIN_*)`).
fn parent_of(hook: TcAttachType) -> u32 {
    match hook {
        TcAttachType::Ingress => 0xffff_fff2,
        TcAttachType::Egress => 0xffff_fff3,
        TcAttachType::Custom(p) => p,
    }
}

/// The netlink attributes of `buf`: (type without flags, payload).
fn attrs(mut buf: &[u8]) -> Vec<(u16, &[u8])> {
    let mut out = Vec::new();
    while buf.len() >= 4 {
        let len = u16::from_ne_bytes([buf[0], buf[1]]) as usize;
        let ty = u16::from_ne_bytes([buf[2], buf[3]]) & 0x3fff;
        if len < 4 || len > buf.len() {
            break;
        }
        out.push((ty, &buf[4..len]));
        let next = (len + 3) & !3;
        buf = buf.get(next..).unwrap_or(&[]);
    }
    out
}

fn cstr(b: &[u8]) -> String {
    let end = b.iter().position(|c| *c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

fn u32_of(b: &[u8]) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(..4)?.try_into().ok()?))
}

/// The filter of one `RTM_NEWTFILTER` message (`None` for the message the
/// kernel sends per priority with no filter, or another kind than `bpf`).
fn parse_filter(msg: &[u8]) -> Option<TcFilter> {
    let tcm = msg.get(..TCMSG_LEN)?;
    let handle = u32_of(&tcm[8..12])?;
    let info = u32_of(&tcm[16..20])?;
    if handle == 0 {
        return None;
    }
    let mut kind = String::new();
    let mut f = TcFilter {
        priority: (info >> 16) as u16,
        handle,
        name: String::new(),
        prog_id: 0,
        direct_action: false,
    };
    for (ty, data) in attrs(&msg[TCMSG_LEN..]) {
        match ty {
            TCA_KIND => kind = cstr(data),
            TCA_OPTIONS => {
                for (ty, data) in attrs(data) {
                    match ty {
                        TCA_BPF_NAME => f.name = cstr(data),
                        TCA_BPF_ID => f.prog_id = u32_of(data).unwrap_or(0),
                        TCA_BPF_FLAGS => f.direct_action = u32_of(data).unwrap_or(0) & TCA_BPF_FLAG_ACT_DIRECT != 0,
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    (kind == "bpf").then_some(f)
}

/// A `NETLINK_ROUTE` socket, closed on drop.
struct Socket(std::os::fd::OwnedFd);

impl Socket {
    fn open() -> io::Result<Socket> {
        use std::os::fd::FromRawFd;
        // SAFETY: plain socket(2) call.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::NETLINK_ROUTE,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh socket we own.
        Ok(Socket(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }))
    }

    fn raw(&self) -> i32 {
        use std::os::fd::AsRawFd;
        self.0.as_raw_fd()
    }
}

/// The `bpf` filters on hook `hook` of interface `ifindex` (a netlink
/// dump, read-only). No `clsact` qdisc (or no interface) is no filter.
pub fn list_filters(ifindex: u32, hook: TcAttachType) -> io::Result<Vec<TcFilter>> {
    let sock = Socket::open()?;
    let mut req = [0u8; NLMSG_HDR + TCMSG_LEN];
    let len = req.len() as u32;
    req[0..4].copy_from_slice(&len.to_ne_bytes());
    req[4..6].copy_from_slice(&(libc::RTM_GETTFILTER).to_ne_bytes());
    req[6..8].copy_from_slice(&((libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16).to_ne_bytes());
    req[8..12].copy_from_slice(&1u32.to_ne_bytes());
    // tcmsg: family AF_UNSPEC, ifindex, handle 0, parent, info 0.
    req[NLMSG_HDR + 4..NLMSG_HDR + 8].copy_from_slice(&(ifindex as i32).to_ne_bytes());
    req[NLMSG_HDR + 12..NLMSG_HDR + 16].copy_from_slice(&parent_of(hook).to_ne_bytes());
    // SAFETY: valid buffer and length.
    if unsafe { libc::send(sock.raw(), req.as_ptr().cast(), req.len(), 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut out = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // SAFETY: valid buffer and length.
        let n = unsafe { libc::recv(sock.raw(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut rest = &buf[..n as usize];
        while rest.len() >= NLMSG_HDR {
            let mlen = u32::from_ne_bytes(rest[0..4].try_into().expect("4 bytes")) as usize;
            let mtype = u16::from_ne_bytes([rest[4], rest[5]]);
            if mlen < NLMSG_HDR || mlen > rest.len() {
                return Err(io::Error::other("truncated netlink message"));
            }
            let body = &rest[NLMSG_HDR..mlen];
            match i32::from(mtype) {
                libc::NLMSG_DONE => return Ok(out),
                libc::NLMSG_ERROR => {
                    let errno = body
                        .get(..4)
                        .map(|b| i32::from_ne_bytes(b.try_into().expect("4 bytes")));
                    return match errno {
                        Some(0) => Ok(out),
                        // No qdisc, no such hook or interface: no filter.
                        Some(e) if matches!(-e, libc::EINVAL | libc::ENOENT | libc::ENODEV) => Ok(Vec::new()),
                        Some(e) => Err(io::Error::from_raw_os_error(-e)),
                        None => Err(io::Error::other("short netlink error")),
                    };
                }
                _ if mtype == libc::RTM_NEWTFILTER => out.extend(parse_filter(body)),
                _ => {}
            }
            rest = rest.get((mlen + 3) & !3..).unwrap_or(&[]);
        }
    }
}

/// Every interface of this network namespace: (ifindex, name).
pub(crate) fn interfaces() -> io::Result<Vec<(u32, String)>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/sys/class/net")?.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Ok(i) = std::fs::read_to_string(entry.path().join("ifindex")) {
            if let Ok(i) = i.trim().parse() {
                out.push((i, name));
            }
        }
    }
    Ok(out)
}

/// The id of the `NPM_EP_SLOTS` map pinned under `pin_dir`: the programs
/// of that pin directory (any of its agents) use it, no other program does.
pub(crate) fn owner_map_id(pin_dir: &Path) -> Result<u32, EbpfError> {
    let path = pin_dir.join(maps::EP_SLOTS);
    if !path.exists() {
        return Err(EbpfError::NotPinned { path });
    }
    let data = MapData::from_pin(&path).map_err(map_err(maps::EP_SLOTS, "open pin"))?;
    Ok(data.info().map_err(map_err(maps::EP_SLOTS, "map info"))?.id())
}

/// npm's filters on every interface: (ifindex, pod direction) -> program
/// id. Filters of any pin directory.
pub(crate) fn npm_filters() -> Result<BTreeMap<(u32, u8), u32>, EbpfError> {
    let netlink = |op: &'static str| move |source| EbpfError::Netlink { op, source };
    let mut out = BTreeMap::new();
    for (ifindex, _) in interfaces().map_err(netlink("list interfaces"))? {
        for d in [DIR_INGRESS, DIR_EGRESS] {
            for f in list_filters(ifindex, hook_of(d)).map_err(netlink("dump tc filters"))? {
                if f.is_npm(d) {
                    out.insert((ifindex, d), f.prog_id);
                }
            }
        }
    }
    Ok(out)
}

/// npm's filters whose program uses the map of id `owner` (see
/// [`owner_map_id`]): (ifindex, pod direction) -> program id.
pub(crate) fn owned_filters(owner: u32) -> Result<BTreeMap<(u32, u8), u32>, EbpfError> {
    Ok(owned_among(npm_filters()?, owner))
}

/// The filters of `found` (see [`npm_filters`]) whose program uses the
/// map of id `owner`.
pub(crate) fn owned_among(found: BTreeMap<(u32, u8), u32>, owner: u32) -> BTreeMap<(u32, u8), u32> {
    if found.is_empty() {
        return found;
    }
    let wanted: BTreeSet<u32> = found.values().copied().collect();
    let mut owned_progs = BTreeSet::new();
    for info in aya::programs::loaded_programs().flatten() {
        if !wanted.contains(&info.id()) {
            continue;
        }
        if let Ok(Some(ids)) = info.map_ids() {
            if ids.contains(&owner) {
                owned_progs.insert(info.id());
            }
        }
    }
    found.into_iter().filter(|(_, p)| owned_progs.contains(p)).collect()
}

/// npm's filters of the pin directory `pin_dir` (none when its maps are
/// not pinned).
pub(crate) fn filters_of(pin_dir: &Path) -> Result<BTreeMap<(u32, u8), u32>, EbpfError> {
    match owner_map_id(pin_dir) {
        Ok(owner) => owned_filters(owner),
        Err(EbpfError::NotPinned { .. }) => Ok(BTreeMap::new()),
        Err(e) => Err(e),
    }
}
