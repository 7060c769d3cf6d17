//! `npm-cni`: a CNI chained plugin that holds a pod's start until the node's npm agent has programmed
//! the pod's endpoint, so that no packet reaches or leaves a new pod before its policies are enforced.
//!
//! It is listed after the interface plugin (`ptp`, `bridge`, ...) in a conflist. On ADD it tells the
//! agent (over a unix socket, see [`proto`]) the pod named in `CNI_ARGS`, its host-side interfaces and
//! its addresses from `prevResult`, waits for the agent to answer "programmed" and prints `prevResult`
//! unchanged; if the agent does not answer within `timeoutSeconds` ADD fails with code 11 (try again
//! later), unless `failOpen` is set. DEL tells the agent to evict the endpoint and always succeeds;
//! CHECK asks whether the endpoint is programmed; STATUS and GC (CNI 1.1) are forwarded too.
//!
//! # Usage
//!
//! **How a runtime calls it.** containerd or CRI-O run the conflist of the node's primary CNI:
//! each plugin in turn, with no arguments, `CNI_COMMAND` (`ADD`, `DEL`, `CHECK`, ...), `CNI_CONTAINERID`,
//! `CNI_NETNS`, `CNI_IFNAME`, `CNI_ARGS` (the kubelet's runtimes put `K8S_POD_NAMESPACE`,
//! `K8S_POD_NAME` and `K8S_POD_UID` there) and `CNI_PATH` (where `npm-cni` must be found) in the
//! environment, and the plugin's entry on stdin with `name`, `cniVersion` and, for every plugin but
//! the first, `prevResult` (the previous plugin's result) inserted. npm-cni goes last:
//!
//! ```json
//! {"cniVersion":"1.0.0","name":"k8s-pod-network","plugins":[
//!   {"type":"ptp","ipam":{"type":"host-local","subnet":"10.244.1.0/24"}},
//!   {"type":"npm-cni","agentSocket":"/run/npm/cni.sock","timeoutSeconds":10,"failOpen":false}]}
//! ```
//!
//! **How it is installed.** The chart's `install-cni` init container runs the installer of the
//! same binary on the host's directories:
//!
//! ```text
//! npm-cni install --bin-dir /host/opt/cni/bin --conf-dir /host/etc/cni/net.d \
//!     [--socket PATH] [--timeout-seconds N] [--fail-open] [--source PATH] [--wait-seconds N]
//! npm-cni uninstall --bin-dir /host/opt/cni/bin --conf-dir /host/etc/cni/net.d
//! ```
//!
//! `install` copies the binary (its own executable, `/proc/self/exe`, or `--source`) to
//! `BIN_DIR/npm-cni` (temporary file, fsync, rename; skipped if identical), then appends the entry
//! above to the `plugins` of the file the runtime uses: the first of the directory's `*.conf`,
//! `*.conflist` and `*.json` files by name, as libcni picks it. That file **must be a `.conflist`**:
//! a runtime reads any other file as one plugin, in which npm-cni cannot be chained, so `install`
//! refuses it with an error naming it (the common CNIs, Calico, Cilium, Flannel, the AWS VPC CNI and
//! kindnet, all write conflists). It also refuses a conflist whose `cniVersion` npm-cni does not
//! speak (see [`version`]: 0.3.0 to 1.1.0; Flannel's and Calico's stock conflists say
//! `"cniVersion": "0.3.1"`), since every ADD would then fail. Running it again changes nothing;
//! with other flag values it updates the entry's values in place and keeps it last. The conflist is
//! rewritten atomically and only the bytes of the entry change, so every other key, its order and
//! formatting stay as the primary CNI wrote them (a symlinked conflist stays a link; its target is
//! rewritten). With no configuration yet (a fresh node where the
//! CNI's daemonset starts after npm) it fails at once, or polls up to `--wait-seconds`.
//! `uninstall` removes the entry from every conflist of the directory (giving back the file as it
//! was before `install`, byte for byte) and then the binary; it succeeds when nothing is installed.
//! Both are also a library, [`install`], for `npm-agent cleanup`. A primary CNI that regenerates its
//! conflist drops the entry: run `install` again (the init container does whenever the agent's pod starts).
//!
//! | module | owns |
//! |---|---|
//! | [`cli`] | the operator command line: `install`, `uninstall`, `--version`, `--help` |
//! | [`install`] | installing and removing the binary and the conflist entry |
//! | [`proto`] | the plugin-agent wire protocol, its codec and the blocking client |
//! | [`config`] | the network configuration keys, defaults and validation |
//! | [`env`](mod@env) | the `CNI_*` environment variables and the pod in `CNI_ARGS` |
//! | [`prev_result`] | what is read from `prevResult` |
//! | [`plugin`] | one invocation: command dispatch, output and exit code |
//! | [`version`] | supported spec versions and the VERSION reply |
//! | [`error`] | the CNI error result and its codes |
//!
//! The CNI types are written here rather than taken from a crate: `cni-plugin` (0.2, last released
//! in 2021) stops at spec 1.0.0 (no STATUS, GC), and re-serializing `prevResult` through typed structs
//! (its approach, and that of the other crates) would drop fields a chained plugin must pass through.
//! npm-cni keeps `prevResult` as a JSON value and reads only what it needs from it.

#![warn(missing_docs)]

pub mod cli;
pub mod config;
pub mod env;
pub mod error;
pub mod install;
pub mod plugin;
pub mod prev_result;
pub mod proto;
pub mod version;
