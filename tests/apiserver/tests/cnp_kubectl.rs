//! ClusterNetworkPolicy through the real `kubectl`: 404 before the CRD,
//! `kubectl apply -f` of the vendored CRD (standard, then experimental), discovery and short
//! names, CNP apply/get/delete, structural pruning (strict field validation refuses unknown
//! fields, `--validate=false` drops them, an experimental peer sent to a standard-channel
//! server is pruned to an empty peer and refused, the experimental channel keeps it), and
//! every invalid form the CRD forbids refused with its field and message.

mod common;

use common::{write, Kubectl, TempDir};
use npm_testapi::{CnpChannel, Options, TestApiServer};

/// A valid CNP with `extra` appended under `spec.egress` (YAML, indented for a list item).
fn cnp(name: &str, extra_egress: &str) -> String {
    format!(
        "apiVersion: policy.networking.k8s.io/v1alpha2\nkind: ClusterNetworkPolicy\nmetadata:\n  name: {name}\nspec:\n  tier: Admin\n  priority: 10\n  subject:\n    namespaces:\n      matchLabels: {{team: a}}\n  ingress:\n  - name: from-monitoring\n    action: Accept\n    from:\n    - namespaces:\n        matchLabels: {{kubernetes.io/metadata.name: monitoring}}\n    protocols:\n    - tcp:\n        destinationPort:\n          range: {{start: 8000, end: 8080}}\n  egress:\n  - action: Deny\n    to:\n    - networks: [169.254.169.254/32]\n{extra_egress}"
    )
}

fn setup(tag: &str, opts: Options) -> (TempDir, TestApiServer, Kubectl) {
    let dir = TempDir::new(tag);
    let server = TestApiServer::start_background(opts).expect("server starts");
    let kubeconfig = dir.0.join("kubeconfig.yaml");
    server.kubeconfig(&kubeconfig).expect("kubeconfig written");
    let k = Kubectl {
        kubeconfig,
        cache: dir.0.join("cache"),
    };
    (dir, server, k)
}

#[test]
fn kubectl_installs_the_crd_and_manages_cluster_network_policies() {
    let (dir, server, k) = setup("cnp-kubectl", Options::default());
    // Before the CRD: the resource is unknown to discovery and its path answers 404.
    let o = k.run(&["get", "clusternetworkpolicies"]);
    assert!(
        !o.ok && o.stderr.contains("doesn't have a resource type"),
        "{}",
        o.stderr
    );
    let o = k.run(&[
        "get",
        "--raw",
        "/apis/policy.networking.k8s.io/v1alpha2/clusternetworkpolicies",
    ]);
    assert!(!o.ok && o.stderr.contains("NotFound"), "{}", o.stderr);

    // kubectl apply of the vendored standard CRD installs it.
    let std_crd = CnpChannel::Standard.crd_path();
    let out = k.ok(&["apply", "-f", std_crd.to_str().unwrap()]);
    assert!(
        out.contains(
            "customresourcedefinition.apiextensions.k8s.io/clusternetworkpolicies.policy.networking.k8s.io created"
        ),
        "{out}"
    );
    k.ok(&[
        "wait",
        "--for=condition=Established",
        "--timeout=10s",
        "crd/clusternetworkpolicies.policy.networking.k8s.io",
    ]);
    let res = k.ok(&["api-resources", "--api-group=policy.networking.k8s.io"]);
    assert!(
        res.contains("clusternetworkpolicies") && res.contains("cnp") && res.contains("v1alpha2"),
        "{res}"
    );
    assert!(k.ok(&["api-versions"]).contains("policy.networking.k8s.io/v1alpha2"));

    // Apply, get by short name, update (generation bumps), delete.
    let f = write(&dir.0, "cnp.yaml", &cnp("admin-a", ""));
    assert!(k
        .ok(&["apply", "-f", &f])
        .contains("clusternetworkpolicy.policy.networking.k8s.io/admin-a created"));
    let got = k.json(&["get", "cnp", "admin-a"]);
    assert_eq!(got["apiVersion"], "policy.networking.k8s.io/v1alpha2");
    assert_eq!(got["spec"]["tier"], "Admin");
    assert_eq!(
        got["spec"]["ingress"][0]["protocols"][0]["tcp"]["destinationPort"]["range"]["end"],
        8080
    );
    assert!(got["metadata"].get("namespace").is_none());
    assert_eq!(got["metadata"]["generation"], 1);
    let f = write(
        &dir.0,
        "cnp.yaml",
        &cnp("admin-a", "").replace("priority: 10", "priority: 20"),
    );
    assert!(k.ok(&["apply", "-f", &f]).contains("configured"));
    let got = k.json(&["get", "clusternetworkpolicy", "admin-a"]);
    assert_eq!(
        (got["spec"]["priority"].as_i64(), got["metadata"]["generation"].as_i64()),
        (Some(20), Some(2))
    );
    // `kubectl get` prints the CRD's printer columns (a Table answer).
    let table = k.ok(&["get", "cnp"]);
    let rows: Vec<Vec<&str>> = table.lines().map(|l| l.split_whitespace().collect()).collect();
    assert_eq!(rows[0], ["NAME", "TIER", "PRIORITY", "AGE"], "{table}");
    assert_eq!(rows[1][..3], ["admin-a", "Admin", "20"], "{table}");

    // Pruning. kubectl validates strictly by default: unknown fields are refused, named.
    let future = "    futureField: 1\n";
    let f2 = write(&dir.0, "future.yaml", &cnp("future", future));
    let o = k.run(&["apply", "-f", &f2]);
    assert!(
        !o.ok
            && o.stderr
                .contains("strict decoding error: unknown field \"spec.egress[0].futureField\""),
        "{}",
        o.stderr
    );
    // With --validate=warn the field is dropped with a warning; --validate=false drops it silently.
    let o = k.run(&["apply", "--validate=warn", "-f", &f2]);
    assert!(
        o.ok && o
            .stderr
            .contains("Warning: unknown field \"spec.egress[0].futureField\""),
        "{}{}",
        o.stdout,
        o.stderr
    );
    let got = k.json(&["get", "cnp", "future"]);
    assert!(got["spec"]["egress"][0].get("futureField").is_none(), "{got}");
    assert_eq!(got["spec"]["egress"][0]["action"], "Deny");
    // An experimental peer (nodes) on the standard channel: pruned, leaving an empty peer,
    // which the CRD refuses (as a real standard-channel server does).
    let nodes = "  - action: Accept\n    to:\n    - nodes:\n        matchLabels: {role: infra}\n";
    let f3 = write(&dir.0, "nodes.yaml", &cnp("nodes", nodes));
    let o = k.run(&["apply", "--validate=false", "-f", &f3]);
    assert!(
        !o.ok && o.stderr.contains("spec.egress[1].to[0]: Invalid value: 0: spec.egress[1].to[0] in body should have at least 1 properties"),
        "{}",
        o.stderr
    );

    // Switch to the experimental channel (kubectl apply updates the CRD): nodes is kept.
    let exp_crd = CnpChannel::Experimental.crd_path();
    assert!(k.ok(&["apply", "-f", exp_crd.to_str().unwrap()]).contains("configured"));
    let crd = k.json(&["get", "crd", "clusternetworkpolicies.policy.networking.k8s.io"]);
    assert_eq!(
        crd["metadata"]["annotations"]["policy.networking.k8s.io/channel"],
        "experimental"
    );
    assert_eq!(crd["status"]["acceptedNames"]["shortNames"], serde_json::json!(["cnp"]));
    k.ok(&["apply", "-f", &f3]);
    let got = k.json(&["get", "cnp", "nodes"]);
    assert_eq!(
        got["spec"]["egress"][1]["to"][0]["nodes"]["matchLabels"]["role"],
        "infra"
    );
    // The experimental channel's CEL rule: no named port towards networks/nodes/domainNames.
    let named =
        "  - action: Accept\n    to:\n    - networks: [10.0.0.0/8]\n    protocols:\n    - destinationNamedPort: web\n";
    let o = k.run(&["apply", "-f", &write(&dir.0, "named.yaml", &cnp("named", named))]);
    assert!(
        !o.ok && o.stderr.contains("spec.egress[1]: Invalid value: \"object\": networks/nodes/domainNames peer cannot be set with namedPorts"),
        "{}",
        o.stderr
    );

    // Deleting a CNP, then the CRD (which deletes the remaining CNPs and stops serving them).
    assert!(k.ok(&["delete", "cnp", "admin-a"]).contains("deleted"));
    let o = k.run(&["get", "cnp", "admin-a"]);
    assert!(!o.ok && o.stderr.contains("NotFound"), "{}", o.stderr);
    k.ok(&["delete", "-f", exp_crd.to_str().unwrap()]);
    let o = k.run(&[
        "get",
        "--raw",
        "/apis/policy.networking.k8s.io/v1alpha2/clusternetworkpolicies",
    ]);
    assert!(!o.ok && o.stderr.contains("NotFound"), "{}", o.stderr);
    let o = k.run(&["get", "--raw", "/apis"]);
    assert!(o.ok && !o.stdout.contains("policy.networking.k8s.io"), "{}", o.stdout);
    // Reinstalled, it starts empty: the CRD's deletion deleted its objects.
    server.install_cnp_crd(CnpChannel::Standard).expect("reinstall");
    assert_eq!(k.ok(&["get", "cnp", "-o", "name"]).trim(), "");
    drop(server);
}

/// One invalid form: the YAML of a CNP and what the error must contain.
struct Bad {
    what: &'static str,
    yaml: String,
    field: &'static str,
    message: &'static str,
}

fn bad(what: &'static str, yaml: String, field: &'static str, message: &'static str) -> Bad {
    Bad {
        what,
        yaml,
        field,
        message,
    }
}

#[test]
fn kubectl_is_refused_every_invalid_form_with_its_field() {
    let (dir, _server, k) = setup(
        "cnp-invalid",
        Options {
            cnp_crd: Some(CnpChannel::Standard),
            ..Default::default()
        },
    );
    let base = cnp("bad", "");
    let rules26: String = (0..26)
        .map(|i| format!("  - action: Deny\n    name: r{i}\n    from:\n    - namespaces: {{}}\n"))
        .collect();
    let cases = [
        bad(
            "tier enum",
            base.replace("tier: Admin", "tier: Superuser"),
            "spec.tier",
            "Unsupported value: \"Superuser\": supported values: \"Admin\", \"Baseline\"",
        ),
        bad("tier required", base.replace("  tier: Admin\n", ""), "spec.tier", "Required value"),
        bad(
            "priority above 1000",
            base.replace("priority: 10", "priority: 1001"),
            "spec.priority",
            "Invalid value: 1001: spec.priority in body should be less than or equal to 1000",
        ),
        bad(
            "negative priority",
            base.replace("priority: 10", "priority: -1"),
            "spec.priority",
            "Invalid value: -1: spec.priority in body should be greater than or equal to 0",
        ),
        bad(
            "priority of the wrong type",
            base.replace("priority: 10", "priority: high"),
            "spec.priority",
            "Invalid value: \"string\": spec.priority in body must be of type integer: \"string\"",
        ),
        bad(
            "subject with namespaces and pods",
            base.replace(
                "  subject:\n",
                "  subject:\n    pods:\n      namespaceSelector: {}\n      podSelector: {}\n",
            ),
            "spec.subject",
            "Too many: 2: must have at most 1 items",
        ),
        bad(
            "empty subject",
            base.replace("  subject:\n    namespaces:\n      matchLabels: {team: a}\n", "  subject: {}\n"),
            "spec.subject",
            "Invalid value: 0: spec.subject in body should have at least 1 properties",
        ),
        bad(
            "more than 25 ingress rules",
            base.replace("  ingress:\n", &format!("  ingress:\n{rules26}")),
            "spec.ingress",
            "Too many: 27: must have at most 25 items",
        ),
        bad(
            "action enum",
            base.replace("action: Deny", "action: Allow"),
            "spec.egress[0].action",
            "Unsupported value: \"Allow\": supported values: \"Accept\", \"Deny\", \"Pass\"",
        ),
        bad(
            "range start not below end",
            base.replace("start: 8000", "start: 8080"),
            "spec.ingress[0].protocols[0].tcp.destinationPort.range",
            "Invalid value: \"object\": Start port must be less than End port",
        ),
        bad(
            "port out of range",
            base.replace("end: 8080", "end: 70000"),
            "spec.ingress[0].protocols[0].tcp.destinationPort.range.end",
            "Invalid value: 70000: spec.ingress[0].protocols[0].tcp.destinationPort.range.end in body should be less than or equal to 65535",
        ),
        bad(
            "two protocols in one entry",
            base.replace("    - tcp:\n", "    - udp: {destinationPort: {number: 53}}\n      tcp:\n"),
            "spec.ingress[0].protocols[0]",
            "Too many: 2: must have at most 1 items",
        ),
        bad(
            "number and range",
            base.replace("          range:", "          number: 80\n          range:"),
            "spec.ingress[0].protocols[0].tcp.destinationPort",
            "Too many: 2: must have at most 1 items",
        ),
        bad(
            "peer with namespaces and pods",
            base.replace(
                "    - namespaces:\n        matchLabels: {kubernetes.io/metadata.name: monitoring}\n",
                "    - namespaces: {}\n      pods: {podSelector: {}}\n",
            ),
            "spec.ingress[0].from[0]",
            "Too many: 2: must have at most 1 items",
        ),
        bad(
            "pods peer without podSelector",
            base.replace(
                "    - namespaces:\n        matchLabels: {kubernetes.io/metadata.name: monitoring}\n",
                "    - pods: {namespaceSelector: {}}\n",
            ),
            "spec.ingress[0].from[0].pods.podSelector",
            "Required value",
        ),
        bad(
            "no peers",
            base.replace("    to:\n    - networks: [169.254.169.254/32]\n", "    to: []\n"),
            "spec.egress[0].to",
            "Invalid value: 0: spec.egress[0].to in body should have at least 1 items",
        ),
        bad(
            "CIDR syntax",
            base.replace("169.254.169.254/32", "169.254.169.254/33"),
            "spec.egress[0].to[0].networks[0]",
            "Invalid value: \"string\": Invalid CIDR format provided",
        ),
        bad(
            "CIDR without a prefix length",
            base.replace("169.254.169.254/32", "169.254.169.254"),
            "spec.egress[0].to[0].networks[0]",
            "Invalid value: \"string\": Invalid CIDR format provided",
        ),
        bad(
            "rule name too long",
            base.replace("name: from-monitoring", &format!("name: {}", "n".repeat(101))),
            "spec.ingress[0].name",
            "Too long: may not be more than 100 bytes",
        ),
        bad(
            "object name",
            base.replace("name: bad", "name: Bad_Name"),
            "metadata.name",
            "Invalid value: \"Bad_Name\": a lowercase RFC 1123 subdomain",
        ),
    ];
    for (i, c) in cases.iter().enumerate() {
        let f = write(&dir.0, &format!("bad{i}.yaml"), &c.yaml);
        let o = k.run(&["create", "-f", &f]);
        let want = format!("{}: {}", c.field, c.message);
        assert!(
            !o.ok
                && o.stderr.contains("The ClusterNetworkPolicy \"")
                && o.stderr.contains("is invalid: ")
                && o.stderr.contains(&want),
            "{}: expected {want:?} in:\n{}",
            c.what,
            o.stderr
        );
    }
    // The base form itself is valid (so each case fails for its own reason).
    k.ok(&["create", "-f", &write(&dir.0, "good.yaml", &base)]);
}
