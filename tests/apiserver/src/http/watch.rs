//! Watches: the streamed JSON lines of a watch (initial ADDED events, changes filtered by
//! namespace and selectors, BOOKMARKs, a 410 ERROR when the cursor is compacted, the end of
//! a custom resource's watches when its CRD is deleted) and the open-watch accounting.

use super::route::is_true;
use super::AppState;
use crate::selector::Selectors;
use crate::store::{parse_rv, EventType, Kind};
use axum::body::{Body, Bytes};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Counts a watch as open while its streaming task runs.
struct WatchGuard(Arc<AppState>);

impl Drop for WatchGuard {
    fn drop(&mut self) {
        self.0.open_watches.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One watch event as a JSON line (`{"type":...,"object":...}`).
fn event_line(ty: &str, obj: &Value) -> Bytes {
    let mut v = format!("{{\"type\":\"{ty}\",\"object\":").into_bytes();
    // Writing a JSON value into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut v, obj);
    v.extend_from_slice(b"}\n");
    Bytes::from(v)
}

/// A BOOKMARK event at `rv`; `initial_end` marks the end of the initial events.
fn bookmark(kind: Kind, rv: u64, initial_end: bool) -> Bytes {
    let mut meta = json!({"resourceVersion": rv.to_string()});
    if initial_end {
        meta["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    event_line(
        "BOOKMARK",
        &json!({"kind": kind.kind(), "apiVersion": kind.api_version(), "metadata": meta}),
    )
}

/// Start a watch streaming task and answer with its stream of JSON lines.
pub(super) fn watch(
    st: Arc<AppState>,
    kind: Kind,
    ns: Option<String>,
    sel: Selectors,
    q: &HashMap<String, String>,
) -> Response {
    let rv_param = q.get("resourceVersion").cloned().unwrap_or_default();
    let bookmarks = is_true(q, "allowWatchBookmarks");
    let send_initial = is_true(q, "sendInitialEvents");
    let timeout = q
        .get("timeoutSeconds")
        .and_then(|s| s.parse::<u64>().ok())
        .map(Duration::from_secs);
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(1024);
    st.open_watches.fetch_add(1, Ordering::SeqCst);
    st.counters().watches_started += 1;
    let guard = WatchGuard(st.clone());
    let mut drop_rx = st.drop_watches.subscribe();
    drop_rx.borrow_and_update();
    tokio::spawn(async move {
        let _guard = guard;
        let in_scope = |o: &Value| {
            ns.as_deref()
                .is_none_or(|n| o.pointer("/metadata/namespace").and_then(Value::as_str) == Some(n))
                && sel.matches(o)
        };
        let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
        let (mut rev_rx, mut cursor, initial) = {
            let store = st.store();
            let rev_rx = store.subscribe();
            let initial = rv_param.is_empty() || rv_param == "0" || send_initial;
            let cursor = if initial {
                store.rev()
            } else {
                match parse_rv(&rv_param) {
                    Ok(n) => n,
                    Err(e) => {
                        let _ = tx.try_send(event_line("ERROR", &e.to_status()));
                        return;
                    }
                }
            };
            let mut lines = Vec::new();
            if initial {
                for o in store.current(kind, ns.as_deref()) {
                    if in_scope(&o) {
                        lines.push(event_line("ADDED", &o));
                    }
                }
            }
            drop(store);
            (rev_rx, cursor, lines)
        };
        for l in initial {
            if tx.send(l).await.is_err() {
                return;
            }
        }
        if send_initial && bookmarks && tx.send(bookmark(kind, cursor, true)).await.is_err() {
            return;
        }
        let mut tick = tokio::time::interval(st.bookmark_interval);
        tick.tick().await;
        rev_rx.mark_changed();
        loop {
            let sleep_deadline = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                changed = rev_rx.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    let (lines, terminal) = {
                        let store = st.store();
                        match store.events_after(kind, cursor) {
                            Err(e) => (vec![event_line("ERROR", &e.to_status())], true),
                            Ok(evs) => {
                                let mut lines = Vec::new();
                                for ev in evs {
                                    let now_in = in_scope(&ev.obj);
                                    let was_in = ev.prev.as_deref().is_some_and(&in_scope);
                                    match ev.ty {
                                        EventType::Added if now_in => lines.push(event_line("ADDED", &ev.obj)),
                                        EventType::Deleted if was_in || now_in => lines.push(event_line("DELETED", &ev.obj)),
                                        EventType::Modified => match (was_in, now_in) {
                                            (true, true) => lines.push(event_line("MODIFIED", &ev.obj)),
                                            (false, true) => lines.push(event_line("ADDED", &ev.obj)),
                                            (true, false) => {
                                                let mut o = ev.prev.as_deref().cloned().unwrap_or(Value::Null);
                                                o["metadata"]["resourceVersion"] = json!(ev.rev.to_string());
                                                lines.push(event_line("DELETED", &o));
                                            }
                                            (false, false) => {}
                                        },
                                        _ => {}
                                    }
                                }
                                cursor = cursor.max(store.rev());
                                // A custom resource's watch ends when its CRD is deleted
                                // (after the DELETED events of its objects), as on a real
                                // server; the client's re-watch then gets 404.
                                (lines, !store.serves(kind))
                            }
                        }
                    };
                    for l in lines {
                        if tx.send(l).await.is_err() {
                            return;
                        }
                    }
                    if terminal {
                        return;
                    }
                }
                _ = tick.tick(), if bookmarks => {
                    if tx.send(bookmark(kind, cursor, false)).await.is_err() {
                        return;
                    }
                }
                _ = drop_rx.changed() => return,
                _ = sleep_deadline => return,
                _ = tx.closed() => return,
            }
        }
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<Bytes, std::convert::Infallible>(b), rx))
    });
    Response::builder()
        .status(200)
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CACHE_CONTROL, "no-cache, private")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}
