//! The state file of the CNI facts: `cni-attachments.json` in the directory
//! of the socket, rewritten atomically (temporary file, fsync, rename) on
//! every change, so that a restarted agent knows the attachments it was
//! told about (`/run` is a tmpfs: after a reboot the runtime runs ADD for
//! every pod again anyway).

use std::io::Write;
use std::path::{Path, PathBuf};

use npm_cni::proto::PodRef;
use serde::{Deserialize, Serialize};

use super::facts::{Attachment, NodeFacts};

/// Name of the state file, next to the socket.
pub const STATE_FILE_NAME: &str = "cni-attachments.json";

/// Version of the state file's layout.
const STATE_VERSION: u32 = 1;

/// Errors reading or writing the state file.
#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    /// Reading, writing or renaming failed.
    #[error("CNI state file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a state file of this layout.
    #[error("CNI state file {path} is not readable: {detail}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
}

#[derive(Serialize, Deserialize)]
struct StateFile {
    version: u32,
    attachments: Vec<Attachment>,
    tombstones: Vec<PodRef>,
}

/// The state file that goes with the socket `socket`.
pub fn state_file_for(socket: &Path) -> PathBuf {
    socket.parent().unwrap_or(Path::new(".")).join(STATE_FILE_NAME)
}

/// The facts saved in `path`; none when the file does not exist.
pub fn load(path: &Path) -> Result<NodeFacts, PersistError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(NodeFacts::default()),
        Err(source) => {
            return Err(PersistError::Io {
                path: path.into(),
                source,
            })
        }
    };
    let file: StateFile = serde_json::from_slice(&bytes).map_err(|e| PersistError::Invalid {
        path: path.into(),
        detail: e.to_string(),
    })?;
    if file.version != STATE_VERSION {
        return Err(PersistError::Invalid {
            path: path.into(),
            detail: format!("layout version {} (this agent reads {STATE_VERSION})", file.version),
        });
    }
    Ok(NodeFacts::restore(file.attachments, file.tombstones))
}

/// Write `facts` to `path` atomically.
pub fn save(path: &Path, facts: &NodeFacts) -> Result<(), PersistError> {
    let io = |source| PersistError::Io {
        path: path.into(),
        source,
    };
    let file = StateFile {
        version: STATE_VERSION,
        attachments: facts.attachments().cloned().collect(),
        tombstones: facts.tombstones().cloned().collect(),
    };
    let bytes = serde_json::to_vec_pretty(&file).expect("the state file always serializes");
    let tmp = path.with_extension(format!("json.tmp{}", std::process::id()));
    let mut f = std::fs::File::create(&tmp).map_err(io)?;
    f.write_all(&bytes).map_err(io)?;
    f.sync_all().map_err(io)?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_missing_file() {
        let dir = std::env::temp_dir().join(format!("npm-agent-cni-persist-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = state_file_for(&dir.join("cni.sock"));
        assert_eq!(path, dir.join(STATE_FILE_NAME));
        let _ = std::fs::remove_file(&path);
        assert_eq!(load(&path).unwrap().attachments().count(), 0);
        let mut facts = NodeFacts::default();
        let pod = PodRef {
            namespace: "ns".into(),
            name: "p".into(),
            uid: "u1".into(),
        };
        facts.add(Attachment {
            network: "net".into(),
            container_id: "c1".into(),
            ifname: "eth0".into(),
            netns: "/var/run/netns/x".into(),
            pod: pod.clone(),
            host_interface: "veth1".into(),
            ifindex: 7,
            ips: vec!["10.1.0.5".parse().unwrap()],
            seq: 0,
        });
        facts.del(
            &("c9".into(), "eth0".into()),
            Some(&PodRef {
                uid: "u2".into(),
                ..pod
            }),
        );
        save(&path, &facts).unwrap();
        let back = load(&path).unwrap();
        assert_eq!(
            back.attachments().collect::<Vec<_>>(),
            facts.attachments().collect::<Vec<_>>()
        );
        assert!(back.is_tombstoned("u2"));
        std::fs::write(&path, b"{\"version\":9,\"attachments\":[],\"tombstones\":[]}").unwrap();
        assert!(matches!(load(&path), Err(PersistError::Invalid { .. })));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
