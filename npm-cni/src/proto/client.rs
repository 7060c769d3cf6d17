//! The plugin's side of the protocol: one blocking request/response exchange with a hard deadline,
//! on std threads and sockets only (no async runtime, so the binary starts in a millisecond).

use std::io::{self, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use super::{decode_response, encode_request, read_line, ProtoError, Request, Response};

/// Pause between connection attempts while the agent's socket is missing or refuses connections.
const CONNECT_RETRY: Duration = Duration::from_millis(100);

/// How [`exchange`] connects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectMode {
    /// Keep retrying a missing or refusing socket until the deadline (ADD, CHECK: an agent that is
    /// starting is worth waiting for).
    RetryUntilDeadline,
    /// One attempt only (DEL, STATUS: an absent agent is an answer in itself).
    Once,
}

/// Why [`exchange`] got no usable answer.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Nothing listens on the socket (missing, refused) and the deadline passed or one attempt failed.
    #[error("npm agent not reachable on {socket} after {waited:?}: {source}")]
    Unreachable {
        /// The socket path.
        socket: PathBuf,
        /// Time spent trying.
        waited: Duration,
        /// The last connection error.
        source: io::Error,
    },
    /// Connected, but no complete answer arrived before the deadline.
    #[error("npm agent on {socket} did not answer within {timeout:?}")]
    Timeout {
        /// The socket path.
        socket: PathBuf,
        /// The deadline that passed.
        timeout: Duration,
    },
    /// Connected, but the connection failed or closed before a complete answer.
    #[error("npm agent on {socket} gave no answer: {source}")]
    NoAnswer {
        /// The socket path.
        socket: PathBuf,
        /// What happened.
        source: ProtoError,
    },
    /// The agent answered something that is not a response of this protocol.
    #[error("npm agent on {socket} answered garbage: {source}")]
    BadResponse {
        /// The socket path.
        socket: PathBuf,
        /// The decoding error.
        source: ProtoError,
    },
}

impl ClientError {
    /// Whether the agent gave no answer at all (as opposed to a wrong one): what `failOpen` forgives.
    pub fn is_unanswered(&self) -> bool {
        !matches!(self, ClientError::BadResponse { .. })
    }
}

/// Sends one request to the agent at `socket` and waits for its response, all within `timeout`.
///
/// The deadline is hard: the exchange runs on a helper thread and this returns
/// [`ClientError::Timeout`] when it passes, whatever the socket does (the helper thread's own socket
/// timeouts end it soon after).
pub fn exchange(
    socket: &Path,
    request: &Request,
    timeout: Duration,
    mode: ConnectMode,
) -> Result<Response, ClientError> {
    let started = Instant::now();
    let deadline = started + timeout;
    let (tx, rx) = mpsc::channel();
    let path = socket.to_path_buf();
    let line = encode_request(request);
    thread::spawn(move || {
        // The receiver may be gone after a timeout; nothing to do then.
        let _ = tx.send(exchange_blocking(&path, &line, deadline, mode, started));
    });
    match rx.recv_timeout(timeout) {
        Ok(result) => result,
        Err(_) => Err(ClientError::Timeout {
            socket: socket.to_path_buf(),
            timeout,
        }),
    }
}

fn exchange_blocking(
    socket: &Path,
    line: &[u8],
    deadline: Instant,
    mode: ConnectMode,
    started: Instant,
) -> Result<Response, ClientError> {
    let timeout_error = || ClientError::Timeout {
        socket: socket.to_path_buf(),
        timeout: deadline - started,
    };
    let mut stream = loop {
        match UnixStream::connect(socket) {
            Ok(stream) => break stream,
            Err(source) => {
                let retriable = matches!(
                    source.kind(),
                    io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused | io::ErrorKind::WouldBlock
                );
                let now = Instant::now();
                if mode == ConnectMode::Once || !retriable || now + CONNECT_RETRY >= deadline {
                    return Err(ClientError::Unreachable {
                        socket: socket.to_path_buf(),
                        waited: started.elapsed(),
                        source,
                    });
                }
                thread::sleep(CONNECT_RETRY);
            }
        }
    };
    let remaining = deadline.saturating_duration_since(Instant::now());
    if remaining.is_zero() {
        return Err(timeout_error());
    }
    let no_answer = |source: ProtoError| match &source {
        ProtoError::Io(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => timeout_error(),
        _ => ClientError::NoAnswer {
            socket: socket.to_path_buf(),
            source,
        },
    };
    stream
        .set_write_timeout(Some(remaining))
        .map_err(|e| no_answer(e.into()))?;
    stream
        .set_read_timeout(Some(remaining))
        .map_err(|e| no_answer(e.into()))?;
    stream.write_all(line).map_err(|e| no_answer(e.into()))?;
    stream.flush().map_err(|e| no_answer(e.into()))?;
    let answer = match read_line(&stream) {
        Ok(answer) => answer,
        // A too long answer is an answer, and a wrong one.
        Err(source @ ProtoError::TooLarge) => {
            return Err(ClientError::BadResponse {
                socket: socket.to_path_buf(),
                source,
            })
        }
        // Some bytes and then the end: the agent answered, badly.
        Err(source @ ProtoError::Truncated { received }) if received > 0 => {
            return Err(ClientError::BadResponse {
                socket: socket.to_path_buf(),
                source,
            })
        }
        Err(source) => return Err(no_answer(source)),
    };
    decode_response(&answer).map_err(|source| ClientError::BadResponse {
        socket: socket.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::tests::attachment;
    use crate::proto::{read_request, write_response};
    use std::os::unix::net::UnixListener;

    #[test]
    fn exchange_with_std_server() {
        let dir = std::env::temp_dir().join(format!("npm-cni-proto-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.sock");
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap();
        let server = thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let request = read_request(&stream).unwrap();
            write_response(&stream, &Response::ok(Some(3))).unwrap();
            request
        });
        let response = exchange(
            &path,
            &Request::Check(attachment()),
            Duration::from_secs(5),
            ConnectMode::Once,
        )
        .unwrap();
        assert_eq!(response, Response::ok(Some(3)));
        assert_eq!(server.join().unwrap(), Request::Check(attachment()));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
