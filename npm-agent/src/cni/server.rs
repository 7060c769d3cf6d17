//! The unix socket npm-cni talks to: one request line and one response line
//! per connection ([`npm_cni::proto`]), connections served concurrently.

use std::os::unix::fs::{DirBuilderExt, FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use npm_cni::proto::{self, Response};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

use super::{handler, CniContext};

/// How long a connection may take to send its request line.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Errors setting up the socket.
#[derive(Debug, thiserror::Error)]
pub enum CniServerError {
    /// The socket's directory could not be created.
    #[error("CNI socket directory {dir}: {source}")]
    Dir {
        /// The directory.
        dir: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// Something that is not a socket is in the way.
    #[error("CNI socket {socket}: exists and is not a socket; not removing it")]
    NotASocket {
        /// The path.
        socket: PathBuf,
    },
    /// Removing the stale socket, binding or restricting it failed.
    #[error("CNI socket {socket}: {source}")]
    Bind {
        /// The path.
        socket: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// Bind `socket` (creating its directory with mode 0700, replacing a stale
/// socket, mode 0600) and return the future that serves it.
pub fn bind(
    socket: &Path,
    ctx: CniContext,
) -> Result<impl std::future::Future<Output = ()> + Send + 'static, CniServerError> {
    if let Some(dir) = socket.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|source| CniServerError::Dir {
                dir: dir.into(),
                source,
            })?;
    }
    let bind_err = |source| CniServerError::Bind {
        socket: socket.into(),
        source,
    };
    match std::fs::symlink_metadata(socket) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(socket).map_err(bind_err)?,
        Ok(_) => return Err(CniServerError::NotASocket { socket: socket.into() }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(bind_err(e)),
    }
    let listener = UnixListener::bind(socket).map_err(bind_err)?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600)).map_err(bind_err)?;
    tracing::info!(socket = %socket.display(), "serving npm-cni requests");
    Ok(serve(listener, ctx))
}

async fn serve(listener: UnixListener, ctx: CniContext) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let ctx = ctx.clone();
                tokio::spawn(async move { connection(stream, ctx).await });
            }
            Err(e) => {
                ctx.metrics.error("cni-accept");
                tracing::warn!(error = %e, "CNI socket accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Read one request line (at most [`proto::MAX_MESSAGE_BYTES`]).
async fn read_request(stream: &mut UnixStream) -> Result<proto::Request, String> {
    let mut line = Vec::new();
    let limit = proto::MAX_MESSAGE_BYTES as u64 + 1;
    let read = tokio::time::timeout(
        READ_TIMEOUT,
        BufReader::new(&mut *stream).take(limit).read_until(b'\n', &mut line),
    )
    .await;
    match read {
        Err(_) => Err(format!("no complete request within {READ_TIMEOUT:?}")),
        Ok(Err(e)) => Err(format!("reading the request: {e}")),
        Ok(Ok(_)) if line.len() > proto::MAX_MESSAGE_BYTES => {
            Err(format!("request longer than {} bytes", proto::MAX_MESSAGE_BYTES))
        }
        Ok(Ok(_)) if line.last() != Some(&b'\n') => Err(format!(
            "connection closed before a complete request ({} bytes received)",
            line.len()
        )),
        Ok(Ok(_)) => proto::decode_request(&line).map_err(|e| e.to_string()),
    }
}

async fn connection(mut stream: UnixStream, ctx: CniContext) {
    let response = match read_request(&mut stream).await {
        Ok(request) => handler::handle(&ctx, request).await,
        Err(e) => {
            ctx.metrics.cni_request("invalid", "error");
            tracing::warn!(error = %e, "invalid npm-cni request");
            Response::error(e, false)
        }
    };
    if let Err(e) = stream.write_all(&proto::encode_response(&response)).await {
        tracing::debug!(error = %e, "npm-cni went away before the answer");
    }
    let _ = stream.shutdown().await;
}
