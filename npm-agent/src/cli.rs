//! The command line of the `npm-agent` binary (a module of `main.rs`, not
//! of the library): flags, environment variables and defaults of each
//! subcommand, and the agent settings `run`'s flags stand for.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use npm_agent::agent::AgentConfig;
use npm_agent::cni::{ChainConfig, CniConfig};
use npm_agent::dataplanes::ebpf_options;
use npm_agent::dataplanes::{DataplaneKind, DataplaneOptions};
use npm_agent::k8s::ClusterPolicyMode;
use npm_agent::reconcile::established::Established;
use npm_agent::reconcile::SyncConfig;
use npm_agent::telemetry::HealthConfig;
use npm_dataplane::ebpf::AttachMode;
use npm_dataplane::ebpf::{MapSizes, MAP_SIZE_MAX, MAP_SIZE_MIN};
use npm_policy::compiled::CompileOptions;

#[derive(Parser)]
#[command(name = "npm-agent", version, about = "npm NetworkPolicy node agent")]
pub struct Cli {
    /// Log level (a tracing filter such as `info` or `npm_agent=debug`).
    #[arg(long, env = "NPM_LOG_LEVEL", default_value = "info", global = true)]
    pub log_level: String,
    /// Log format.
    #[arg(long, env = "NPM_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum LogFormat {
    Json,
    Text,
}

// Parsed once at start: the size of `Run` (every flag of the agent) costs
// nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
pub enum Command {
    /// Run the agent (the DaemonSet's command).
    Run(RunArgs),
    /// Print what the eBPF dataplane of this node has pinned.
    Inspect(InspectArgs),
    /// Why a flow is allowed or denied on a node: asks that node's agent
    /// (its `/explain`, read-only), which names the deciding policies and
    /// rules and runs the kernel's classifier as a dry run (eBPF).
    Explain(ExplainArgs),
    /// Follow a node's flow records live (its agent's `/observe`, read-only):
    /// each deny (and allow or would-deny, when logged) with its pod, peer,
    /// direction, reason and policies, until interrupted.
    Observe(ObserveArgs),
    /// Reachability matrix of YAML objects, by the compiler's simulator
    /// (the reference evaluator of npm-policy; no kernel, no API server).
    Simulate(SimulateArgs),
    /// Mount bpffs at a path unless a bpf filesystem is mounted there
    /// already (the chart's privileged init container).
    MountBpffs(MountBpffsArgs),
    /// Remove npm from this node: detach every program, remove the pins,
    /// the nftables table and npm-cni (conflist entries and binary).
    Cleanup(CleanupArgs),
    /// Block until SIGTERM or SIGINT, then exit 0 (the cleanup pods' main
    /// container).
    Pause,
    /// The chart's uninstall hook steps.
    Uninstall(UninstallArgs),
}

#[derive(Parser)]
pub struct MountBpffsArgs {
    /// Where bpffs is mounted.
    #[arg(long, default_value = "/sys/fs/bpf")]
    pub path: PathBuf,
}

#[derive(Parser)]
pub struct CleanupArgs {
    /// Only this pin directory (default: every pin directory under
    /// /sys/fs/bpf/npm, i.e. every map layout).
    #[arg(long, env = "NPM_PIN_DIR")]
    pub pin_dir: Option<PathBuf>,
    /// The host's CNI configuration directory.
    #[arg(long, default_value = "/etc/cni/net.d")]
    pub cni_conf_dir: PathBuf,
    /// The host's CNI plugin directory.
    #[arg(long, default_value = "/opt/cni/bin")]
    pub cni_bin_dir: PathBuf,
    /// nftables table name of the nftables dataplane.
    #[arg(long, env = "NPM_NFT_TABLE", default_value = "npm")]
    pub nft_table: String,
}

#[derive(Parser)]
pub struct UninstallArgs {
    #[command(subcommand)]
    pub step: UninstallStep,
}

#[derive(Subcommand)]
pub enum UninstallStep {
    /// Delete the agent DaemonSet (foreground) and wait until it is gone.
    StopAgents(UninstallStepArgs),
    /// Wait until the cleanup DaemonSet is Ready on every node.
    WaitCleanup(UninstallStepArgs),
}

#[derive(Parser)]
pub struct UninstallStepArgs {
    /// Namespace of the DaemonSet.
    #[arg(long)]
    pub namespace: String,
    /// Name of the DaemonSet.
    #[arg(long)]
    pub daemonset: String,
    /// Give up after this long (exit non-zero naming what remains).
    #[arg(long, default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..))]
    pub timeout_seconds: u64,
    /// Kubeconfig file; without it, in-cluster config (or $KUBECONFIG).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
}

#[derive(Parser)]
pub struct RunArgs {
    /// This node's name (pods with this spec.nodeName are local endpoints).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,
    /// Kubeconfig file; without it, in-cluster config (or $KUBECONFIG).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Which dataplane programs the kernel.
    #[arg(long, env = "NPM_DATAPLANE", value_enum, default_value_t = DataplaneKind::Ebpf)]
    pub dataplane: DataplaneKind,
    /// eBPF object (default: the loader's search path).
    #[arg(long, env = "NPM_EBPF_OBJECT")]
    pub bpf_object: Option<PathBuf>,
    /// bpffs pin directory of the eBPF dataplane.
    #[arg(long, env = "NPM_PIN_DIR")]
    pub pin_dir: Option<PathBuf>,
    /// How the eBPF programs are attached to each pod's host-side
    /// interface: `tcx` (tcx links, Linux 6.6 or later), `tc` (a clsact
    /// qdisc and netlink bpf filters at npm's priority 1, handle 0x6e706d,
    /// for kernels without tcx), or `auto`: tcx where the kernel has it,
    /// else tc, and a mode already in place on the node (tcx links pinned,
    /// npm tc filters found) is kept. Either way a restarted agent replaces
    /// the program in place, with no moment unenforced. Before loading, the
    /// agent checks the kernel for what the datapath needs in that mode and
    /// refuses to start, naming what is missing.
    #[arg(long, env = "NPM_ATTACH", default_value = "auto", value_name = "auto|tcx|tc")]
    pub attach: AttachMode,
    /// nftables table name of the nftables dataplane.
    #[arg(long, env = "NPM_NFT_TABLE", default_value = "npm")]
    pub nft_table: String,
    /// Address of /metrics, /healthz and /readyz. The /metrics series that
    /// name pods or policies are served only to a bearer token whose user
    /// may `get` the non-resource URL /metrics (TokenReview and
    /// SubjectAccessReview with the agent's credentials).
    #[arg(long, env = "NPM_METRICS_ADDR", default_value = "0.0.0.0:9090")]
    pub metrics_addr: SocketAddr,
    /// Address of /explain, /observe and the whole /metrics, which name
    /// pods, policies and flows: loopback, reached on the node or through
    /// `kubectl port-forward` to the agent pod (RBAC on `pods/portforward`).
    #[arg(long, env = "NPM_DEBUG_ADDR", default_value = "127.0.0.1:9091")]
    pub debug_addr: SocketAddr,
    /// LIST page size.
    #[arg(long, env = "NPM_PAGE_SIZE", default_value_t = 500)]
    pub page_size: u32,
    /// Time (ms) changes are coalesced for, after the oldest change not yet
    /// programmed, before syncing.
    #[arg(long, env = "NPM_DEBOUNCE_MS", default_value_t = npm_agent::reconcile::DEFAULT_DEBOUNCE_MS)]
    pub debounce_ms: u64,
    /// Share of identities or endpoints whose removal is held until a
    /// direct read of the API server confirms it: in one sync, or in total
    /// against the highest count programmed within the window since the
    /// last confirmation.
    #[arg(long, env = "NPM_MASS_DELETE_THRESHOLD", default_value_t = 0.5)]
    pub mass_delete_threshold: f64,
    /// Window (seconds) of the cumulative mass-deletion check: removals
    /// slower than this are not held.
    #[arg(long, env = "NPM_MASS_DELETE_WINDOW_SECS", default_value_t = 600)]
    pub mass_delete_window_secs: u64,
    /// Let egress-isolated pods reach their own node.
    #[arg(long, env = "NPM_ALLOW_HOST_EGRESS")]
    pub allow_host_egress: bool,
    /// Only interfaces matching this glob (e.g. `veth*`) are pod interfaces.
    #[arg(long, env = "NPM_INTERFACE_PATTERN")]
    pub interface_pattern: Option<String>,
    /// Deny flow log lines per second at most.
    #[arg(long, env = "NPM_FLOW_LOGS_PER_SEC", default_value_t = 10)]
    pub flow_logs_per_sec: u32,
    /// Also log the allowed new connections of every local pod (one
    /// `"verdict":"allow"` flow log line per new connection, within the
    /// same rate): the datapath reports the first packet of each new
    /// tracked flow (eBPF: ring-buffer event; nftables: NFLOG).
    #[arg(long, env = "NPM_FLOW_LOGS_ALLOW")]
    pub flow_logs_allow: bool,
    /// Series per kind of the per-rule (`npm_rule_allowed_*`) and
    /// per-endpoint (`npm_endpoint_denied_*`) counters: beyond it, a new
    /// rule or pod is counted in its direction's `_other` series and in
    /// `npm_rule_metrics_folded` (0: every one is folded).
    #[arg(long, env = "NPM_RULE_METRICS_MAX", default_value_t = npm_agent::telemetry::rule_metrics::DEFAULT_MAX_SERIES)]
    pub rule_metrics_max: usize,
    /// ClusterNetworkPolicies (policy.networking.k8s.io/v1alpha2): `auto`
    /// watches them, and while the API server does not serve them (404:
    /// the CRD is not installed) counts their list as complete and empty
    /// (NetworkPolicy is enforced alone; looked at again with the
    /// watcher's backoff, at most every 30 s); `on` requires them (a 404
    /// keeps the agent unready); `off` never watches them. A 403 (RBAC) is
    /// never an empty list: the agent stays unready, naming it.
    #[arg(long, env = "NPM_CLUSTER_NETWORK_POLICIES", value_enum, default_value_t = ClusterPolicyMode::Auto)]
    pub cluster_network_policies: ClusterPolicyMode,
    /// Connection semantics on a policy change: `keep` lets a tracked
    /// connection flow until it ends (new connections meet the new
    /// policy); `enforce` cuts, after the sync that programmed the
    /// change, the tracked connections the new policy denies (counted in
    /// `npm_connections_cut_total`, logged). The Namespace annotation
    /// `npm.io/established: keep|enforce` overrides it for its pods.
    #[arg(long, env = "NPM_ESTABLISHED", value_enum, default_value_t = Established::Keep)]
    pub established: Established,
    /// Unix socket npm-cni talks to (its state file,
    /// `cni-attachments.json`, is kept in the same directory); an empty
    /// value disables it.
    // Not clap's PathBuf parser: it refuses the empty value.
    #[arg(
        long,
        env = "NPM_CNI_SOCKET",
        default_value = npm_cni::proto::DEFAULT_SOCKET,
        value_parser = clap::builder::TypedValueParser::map(clap::builder::OsStringValueParser::new(), PathBuf::from)
    )]
    pub cni_socket: PathBuf,
    /// The host's CNI configuration directory as this container sees it:
    /// the agent keeps npm-cni chained in the conflist the runtime uses
    /// (checked every `--cni-check-interval-secs`, put back with the init
    /// container's installer when the primary CNI rewrote it) and reports it
    /// (readiness check `cni-chained`, `npm_cni_chained`). Unset: the agent
    /// never looks at the conflist. Needs `--cni-socket`.
    #[arg(long, env = "NPM_CNI_CONF_DIR")]
    pub cni_conf_dir: Option<PathBuf>,
    /// The host's CNI plugin directory as this container sees it (npm-cni's
    /// binary; the entry is put back only while the binary is there).
    #[arg(long, env = "NPM_CNI_BIN_DIR", default_value = "/opt/cni/bin")]
    pub cni_bin_dir: PathBuf,
    /// The npm-cni binary copied into `--cni-bin-dir` when the entry is
    /// put back and the installed copy differs.
    #[arg(long, env = "NPM_CNI_SOURCE", default_value = "/usr/bin/npm-cni")]
    pub cni_source: PathBuf,
    /// `timeoutSeconds` of the entry put back (the init container's
    /// `--timeout-seconds`).
    #[arg(long, env = "NPM_CNI_TIMEOUT_SECONDS", default_value_t = npm_cni::config::DEFAULT_TIMEOUT_SECONDS,
          value_parser = clap::value_parser!(u64).range(1..=npm_cni::config::MAX_TIMEOUT_SECONDS))]
    pub cni_timeout_seconds: u64,
    /// `failOpen` of the entry put back (the init container's
    /// `--fail-open`).
    #[arg(long, env = "NPM_CNI_FAIL_OPEN")]
    pub cni_fail_open: bool,
    /// Seconds between two checks of `--cni-conf-dir`.
    #[arg(long, env = "NPM_CNI_CHECK_INTERVAL_SECS", default_value_t = 2,
          value_parser = clap::value_parser!(u64).range(1..=300))]
    pub cni_check_interval_secs: u64,
    /// Directory of the lock that keeps a second agent off the same pin
    /// directory (or nftables table): `agent-<pin dir>.lock`, a host path.
    #[arg(long, env = "NPM_LOCK_DIR", default_value = npm_agent::lifecycle::lock::DEFAULT_LOCK_DIR)]
    pub lock_dir: PathBuf,
    /// /readyz fails while a mass removal has been held (waiting for a
    /// confirming direct read) longer than this many seconds.
    #[arg(long, env = "NPM_MAX_HELD_REMOVAL_SECS", default_value_t = npm_agent::telemetry::health::DEFAULT_MAX_HELD_REMOVAL_SECS)]
    pub max_held_removal_secs: u64,
    /// /readyz fails while this many applies in a row have failed.
    #[arg(long, env = "NPM_MAX_APPLY_FAILURES", default_value_t = npm_agent::telemetry::health::DEFAULT_MAX_APPLY_FAILURES)]
    pub max_apply_failures: u32,
    /// Patches a second, at most, of local pods' `npm.io/PolicyEnforced` /
    /// `npm.io/PolicyDegraded` conditions (`pods/status`; written only when
    /// a condition's status or reason changes). 0 writes no condition.
    #[arg(long, env = "NPM_POD_CONDITION_QPS", default_value_t = 5.0)]
    pub pod_condition_qps: f64,
    /// Patches at once after a quiet time (the token bucket's size).
    #[arg(long, env = "NPM_POD_CONDITION_BURST", default_value_t = 20)]
    pub pod_condition_burst: u32,
    /// Entries of the eBPF map `NPM_POLICY` (NetworkPolicy allow keys; a
    /// port range takes one key per aligned block). Sizes apply when a map
    /// is created: a map already pinned on the node keeps its size (and its
    /// entries, so enforcement and tracked connections survive) until the
    /// pins are removed (`npm-agent cleanup`, `helm uninstall`, a reboot);
    /// the agent logs the difference. A state that does not fit is
    /// programmed in degraded mode (`npm_map_full{map}`, `/readyz`).
    #[arg(long, env = "NPM_MAP_SIZE_POLICY", default_value_t = npm_common::sizes::POLICY, value_parser = map_size())]
    pub map_size_policy: u32,
    /// Entries of `NPM_TIERS` (ClusterNetworkPolicy tier keys).
    #[arg(long, env = "NPM_MAP_SIZE_TIERS", default_value_t = npm_common::sizes::TIERS, value_parser = map_size())]
    pub map_size_tiers: u32,
    /// Entries of `NPM_IPCACHE` (every pod and node address of the cluster).
    #[arg(long, env = "NPM_MAP_SIZE_IPCACHE", default_value_t = npm_common::sizes::IPCACHE, value_parser = map_size())]
    pub map_size_ipcache: u32,
    /// Entries of `NPM_CIDRS` (distinct ipBlock prefixes).
    #[arg(long, env = "NPM_MAP_SIZE_CIDRS", default_value_t = npm_common::sizes::CIDRS, value_parser = map_size())]
    pub map_size_cidrs: u32,
    /// Entries of each of `NPM_CT` and `NPM_CT4` (tracked connections, LRU:
    /// the oldest flow is evicted when full).
    #[arg(long, env = "NPM_MAP_SIZE_CONNTRACK", default_value_t = npm_common::sizes::CT, value_parser = map_size())]
    pub map_size_conntrack: u32,
    /// eBPF: while a conntrack map is under pressure (its fill at three
    /// quarters, less where the node has many CPUs), an endpoint holding
    /// more than 1/N of it has its new flows dropped (`conntrack-quota`),
    /// so that one pod's flood cannot evict other pods' connections; below
    /// the pressure threshold no endpoint is capped (a busy DNS server
    /// keeps its flows while the map has room). 0: no quota.
    #[arg(long, env = "NPM_CONNTRACK_QUOTA_SHARE", default_value_t = npm_common::CT_QUOTA_SHARE_DEFAULT)]
    pub conntrack_quota_share: u32,
    /// Trusted DNS servers (comma-separated addresses the pods send their
    /// queries to: the cluster DNS Service's ClusterIPs). With any, the
    /// agent learns their UDP answers to this node's pods (an NFQUEUE
    /// through iptables' `mangle` table; each response that teaches a new
    /// address is held until it is programmed), which is what
    /// ClusterNetworkPolicy `domainNames` peers match. Without, such peers
    /// match nothing.
    #[arg(long, env = "NPM_DNS_SERVERS", value_delimiter = ',')]
    pub dns_server: Vec<IpAddr>,
    /// NFQUEUE number of the DNS learning (one agent per number).
    #[arg(long, env = "NPM_DNS_QUEUE", default_value_t = 20049)]
    pub dns_queue: u16,
    /// Longest time (ms) a DNS response that taught a new address is held
    /// until that address is programmed (then released anyway).
    #[arg(long, env = "NPM_DNS_HOLD_MS", default_value_t = 1000)]
    pub dns_hold_ms: u64,
    /// Most DNS responses held at once for their programming; beyond, a
    /// response that taught a new address is let through at once.
    #[arg(long, env = "NPM_DNS_MAX_HOLDS", default_value_t = 256)]
    pub dns_max_holds: usize,
    /// Seconds a learned address is kept beyond its answer's TTL.
    #[arg(long, env = "NPM_DNS_GRACE_SECS", default_value_t = 30)]
    pub dns_grace_secs: u64,
    /// The shortest time (seconds) a learned address is kept, whatever its
    /// answer's TTL: clients and node-local caches keep using an address
    /// well beyond a short TTL (connection pools, runtimes that cache for
    /// their own time), and a connection to it must not be denied then.
    /// 3600, as Cilium's `tofqdns-min-ttl`; 0 keeps each answer's TTL.
    #[arg(long, env = "NPM_DNS_MIN_TTL_SECS", default_value_t = 3600)]
    pub dns_min_ttl_secs: u64,
    /// Where the learned names are kept across restarts (default:
    /// `dns-names-<queue>.json` in `--lock-dir`).
    #[arg(long, env = "NPM_DNS_STATE_FILE")]
    pub dns_state_file: Option<PathBuf>,
    /// Check every flag and the configuration as `run` does, print the
    /// effective configuration as JSON and exit, touching neither the
    /// kernel nor the API server.
    #[arg(long)]
    pub dry_run: bool,
}

#[derive(Parser)]
pub struct ExplainArgs {
    /// The agent's metrics listener, `http://HOST:PORT`.
    #[arg(long, env = "NPM_AGENT", default_value = "http://127.0.0.1:9091")]
    pub agent: String,
    /// The sender: `NAMESPACE/POD` or an IP address.
    #[arg(long)]
    pub from: String,
    /// The receiver: `NAMESPACE/POD` or an IP address.
    #[arg(long)]
    pub to: String,
    /// Destination port.
    #[arg(long)]
    pub port: u16,
    /// `TCP`, `UDP` or `SCTP`.
    #[arg(long, default_value = "TCP")]
    pub protocol: String,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Parser)]
pub struct ObserveArgs {
    /// The agent's metrics listener, `http://HOST:PORT`.
    #[arg(long, env = "NPM_AGENT", default_value = "http://127.0.0.1:9091")]
    pub agent: String,
    /// Print each record as the agent's JSON (one object per line).
    #[arg(long)]
    pub json: bool,
    /// Only records whose pod or peer pod is in this namespace.
    #[arg(long)]
    pub namespace: Option<String>,
    /// Only records whose pod or peer pod is `NAMESPACE/POD`.
    #[arg(long)]
    pub pod: Option<String>,
    /// Only records of this verdict.
    #[arg(long, value_parser = ["allow", "deny", "would-deny"])]
    pub verdict: Option<String>,
}

#[derive(Parser)]
pub struct SimulateArgs {
    /// YAML files of Namespace, Pod and NetworkPolicy objects.
    #[arg(short = 'f', long = "file", required = true)]
    pub files: Vec<PathBuf>,
    /// Destination port.
    #[arg(long, default_value_t = 80)]
    pub port: u16,
    /// TCP, UDP or SCTP.
    #[arg(long, default_value = "TCP")]
    pub protocol: String,
}

#[derive(Parser)]
pub struct InspectArgs {
    /// bpffs pin directory of the eBPF dataplane.
    #[arg(long, env = "NPM_PIN_DIR")]
    pub pin_dir: Option<PathBuf>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// The parser of a `--map-size-*` value: an integer in
/// [`MAP_SIZE_MIN`]..=[`MAP_SIZE_MAX`] (clap names the flag and the bounds).
fn map_size() -> clap::builder::RangedI64ValueParser<u32> {
    clap::value_parser!(u32).range(i64::from(MAP_SIZE_MIN)..=i64::from(MAP_SIZE_MAX))
}

impl RunArgs {
    /// The eBPF map sizes of the `--map-size-*` flags.
    pub fn map_sizes(&self) -> MapSizes {
        MapSizes {
            policy: self.map_size_policy,
            tiers: self.map_size_tiers,
            ipcache: self.map_size_ipcache,
            cidrs: self.map_size_cidrs,
            conntrack: self.map_size_conntrack,
            conntrack_quota_share: self.conntrack_quota_share,
        }
    }

    /// The readiness and liveness settings of the flags.
    pub fn health_config(&self) -> HealthConfig {
        HealthConfig {
            max_held_removal: Duration::from_secs(self.max_held_removal_secs),
            max_apply_failures: self.max_apply_failures,
            ..HealthConfig::default()
        }
    }

    /// The key of the one-agent lock and how errors name it: the effective
    /// pin directory (eBPF) or the table (nftables).
    pub fn lock_key(&self) -> (String, String) {
        match self.dataplane {
            DataplaneKind::Ebpf => {
                let dir = ebpf_options(&self.dataplane_options()).pin_dir;
                (dir.display().to_string(), format!("pin dir {}", dir.display()))
            }
            DataplaneKind::Nftables => (
                format!("nft-{}", self.nft_table),
                format!("nftables table {}", self.nft_table),
            ),
        }
    }

    /// The dataplane options of the flags.
    pub fn dataplane_options(&self) -> DataplaneOptions {
        DataplaneOptions {
            bpf_object: self.bpf_object.clone(),
            pin_dir: self.pin_dir.clone(),
            attach: self.attach,
            map_sizes: self.map_sizes(),
            nft_table: self.nft_table.clone(),
        }
    }

    /// The agent settings of the flags, with this node's addresses
    /// `node_ips`.
    pub fn agent_config(&self, node_ips: Vec<IpAddr>) -> AgentConfig {
        AgentConfig {
            sync: SyncConfig {
                compile: CompileOptions {
                    node_name: self.node_name.clone(),
                    node_ips,
                    allow_host_egress: self.allow_host_egress,
                    report_new: self.flow_logs_allow,
                },
                debounce: Duration::from_millis(self.debounce_ms),
                mass_delete_threshold: self.mass_delete_threshold,
                mass_delete_window: Duration::from_secs(self.mass_delete_window_secs),
                page_size: self.page_size,
                flow_logs_per_sec: self.flow_logs_per_sec,
                flow_logs_allow: self.flow_logs_allow,
                cluster_policies: self.cluster_network_policies,
                established: self.established,
                bridge_netfilter: (self.dataplane == DataplaneKind::Nftables).then(Default::default),
                ..SyncConfig::default()
            },
            page_size: self.page_size,
            metrics_addr: Some(self.metrics_addr),
            debug_addr: Some(self.debug_addr),
            cni: (!self.cni_socket.as_os_str().is_empty()).then(|| CniConfig {
                keep_chained: self.cni_conf_dir.clone().map(|conf_dir| ChainConfig {
                    conf_dir,
                    bin_dir: self.cni_bin_dir.clone(),
                    source: self.cni_source.clone(),
                    entry: npm_cni::install::Entry {
                        agent_socket: self.cni_socket.to_string_lossy().into_owned(),
                        timeout_seconds: self.cni_timeout_seconds,
                        fail_open: self.cni_fail_open,
                    },
                    interval: Duration::from_secs(self.cni_check_interval_secs),
                }),
                ..CniConfig::new(self.cni_socket.clone())
            }),
            dns: (!self.dns_server.is_empty()).then(|| npm_agent::dns::CaptureConfig {
                hold: std::time::Duration::from_millis(self.dns_hold_ms),
                max_holds: self.dns_max_holds,
                limits: npm_agent::dns::learner::Limits {
                    grace: std::time::Duration::from_secs(self.dns_grace_secs),
                    min_ttl: std::time::Duration::from_secs(self.dns_min_ttl_secs),
                    ..Default::default()
                },
                state_file: Some(
                    self.dns_state_file
                        .clone()
                        .unwrap_or_else(|| self.lock_dir.join(format!("dns-names-{}.json", self.dns_queue))),
                ),
                ..npm_agent::dns::CaptureConfig::new(self.dns_server.clone(), self.dns_queue)
            }),
            pod_conditions: (self.pod_condition_qps > 0.0).then_some(
                npm_agent::k8s::pod_conditions::PodConditionsConfig {
                    qps: self.pod_condition_qps,
                    burst: self.pod_condition_burst,
                },
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    fn run_args(extra: &[&str]) -> RunArgs {
        let mut argv = vec!["npm-agent", "run", "--node-name", "n1"];
        argv.extend_from_slice(extra);
        match Cli::try_parse_from(argv).expect("parse").command {
            Command::Run(a) => a,
            _ => panic!("not run"),
        }
    }

    #[test]
    fn front_size_flags_are_gone() {
        assert_eq!(run_args(&[]).map_sizes(), MapSizes::default());
        // Layout 7 has no fronts: their flags are refused, not ignored.
        for flag in ["--map-size-policy-front", "--map-size-tier-front"] {
            let argv = ["npm-agent", "run", "--node-name", "n1", flag, "1024"];
            assert!(Cli::try_parse_from(argv).is_err(), "{flag} accepted");
        }
    }

    #[test]
    fn flow_logs_allow_is_a_compile_option() {
        let on = run_args(&["--flow-logs-allow"]).agent_config(vec![]);
        assert!(on.sync.flow_logs_allow && on.sync.compile.report_new);
        let off = run_args(&[]).agent_config(vec![]);
        assert!(!off.sync.flow_logs_allow && !off.sync.compile.report_new);
    }
}
