//! `npm-agent pause`: blocks until SIGTERM or SIGINT, then exits 0. The
//! chart's cleanup DaemonSet runs it as its main container (the image has
//! no shell or `sleep`), so a pod turns Ready once its init container's
//! `npm-agent cleanup` succeeded, and stops at once when deleted.

use tokio::signal::unix::{signal, SignalKind};

/// Wait for SIGTERM or SIGINT; returns the signal's name.
pub async fn pause() -> std::io::Result<&'static str> {
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    Ok(tokio::select! {
        _ = sigterm.recv() => "SIGTERM",
        _ = sigint.recv() => "SIGINT",
    })
}
