#!/usr/bin/env python3
"""Generates the conformance catalogue (tests/conformance/*.yaml).

Each case is written here once: the policies, the actions, and the expected
reachability expressed the way the specification reasons about it ("every
pod -> x/a is denied except x/b", "x/a's egress is denied"), starting from a
fully connected matrix. The expectations were derived by hand from
/work/shared/reference/networkpolicy-semantics.md (not from any evaluator);
the simulator (npm-policy) and the real datapaths are checked against them.

Run:  python3 tests/conformance/gen/catalogue.py   (rewrites the YAML files)
"""
import os
import sys

NS = ["x", "y", "z"]
PODS = [f"{n}/{p}" for n in NS for p in ["a", "b", "c"]]
MD = "kubernetes.io/metadata.name"
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


# ---------------------------------------------------------------- reachability
class R:
    """A reachability matrix, fully connected to start with."""

    def __init__(self, pods=None, default=True):
        self.pods = list(pods or PODS)
        self.m = {s: {d: default for d in self.pods} for s in self.pods}

    def _sel(self, spec):
        # spec: None = every pod, "x" = namespace, "x/a" = pod, list = union
        if spec is None:
            return list(self.pods)
        if isinstance(spec, list):
            out = []
            for s in spec:
                out += self._sel(s)
            return out
        if "/" in spec:
            return [spec] if spec in self.pods else []
        return [p for p in self.pods if p.split("/")[0] == spec]

    def peer(self, src, dst, v):
        for s in self._sel(src):
            for d in self._sel(dst):
                self.m[s][d] = v
        return self

    def ingress(self, dst, v):
        return self.peer(None, dst, v)

    def egress(self, src, v):
        return self.peer(src, None, v)

    def probe(self, port, proto="TCP"):
        out = {"port": port, "protocol": proto}
        if self.pods != PODS:
            out["pods"] = list(self.pods)
        out["matrix"] = {
            s: "".join("1" if self.m[s][d] else "0" for d in self.pods) for s in self.pods
        }
        return out


# ---------------------------------------------------------------- policies
def ml(**labels):
    return {"matchLabels": dict(labels)}


def expr(key, op, values=None):
    r = {"key": key, "operator": op}
    if values is not None:
        r["values"] = list(values)
    return {"matchExpressions": [r]}


def nsname(n):
    return {"matchLabels": {MD: n}}


def policy(ns, name, pod_selector=None, ingress=None, egress=None, types=None):
    """A NetworkPolicy; `ingress`/`egress` None = field absent. `types` None
    = policyTypes absent (API defaulting applies)."""
    spec = {"podSelector": pod_selector if pod_selector is not None else {}}
    if ingress is not None:
        spec["ingress"] = ingress
    if egress is not None:
        spec["egress"] = egress
    if types is not None:
        spec["policyTypes"] = list(types)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"namespace": ns, "name": name},
        "spec": spec,
    }


def port(p=None, proto=None, end=None):
    out = {}
    if proto is not None:
        out["protocol"] = proto
    if p is not None:
        out["port"] = p
    if end is not None:
        out["endPort"] = end
    return out


def create(p):
    return {"create_policy": p}


def update(p):
    return {"update_policy": p}


def step(actions, *probes):
    return {"actions": list(actions), "probes": list(probes)}


def case(cid, title, *steps):
    return {"id": cid, "title": title, "steps": list(steps)}


UP = "upstream: Netpol NetworkPolicy between server and client"
UP_UDP = "upstream: Netpol [LinuxOnly] NetworkPolicy between server and client using UDP"
UP_SCTP = "upstream: Netpol [Feature:SCTPConnectivity] [LinuxOnly] NetworkPolicy between server and client using SCTP"


def t(name, ctx=UP):
    return f"{ctx} {name}"


# ---------------------------------------------------------------- ingress
ingress_cases = [
    case("default-deny-ingress", t("should support a 'default-deny-ingress' policy"),
         step([create(policy("x", "deny-ingress", {}, types=["Ingress"]))],
              R().ingress("x", False).probe(80))),
    case("default-deny-all", t("should support a 'default-deny-all' policy"),
         step([create(policy("x", "deny-all", {}, types=["Ingress", "Egress"]))],
              R().ingress("x", False).egress("x", False).probe(80))),
    case("ingress-podselector-same-ns",
         t("should enforce policy to allow traffic from pods within server namespace based on PodSelector"),
         step([create(policy("x", "x-a-allows-x-b", ml(pod="a"),
                             ingress=[{"from": [{"podSelector": ml(pod="b")}]}], types=["Ingress"]))],
              R().ingress("x/a", False).peer("x/b", "x/a", True).probe(80))),
    case("ingress-allow-for-target", t("should enforce policy to allow ingress traffic for a target"),
         step([create(policy("x", "deny-all", {}, types=["Ingress"])),
               create(policy("x", "allow-all-to-a", ml(pod="a"),
                             ingress=[{"from": [{"podSelector": {}, "namespaceSelector": {}}]}],
                             types=["Ingress"]))],
              R().ingress(["x/b", "x/c"], False).probe(80))),
    case("ingress-from-all-namespaces",
         t("should enforce policy to allow ingress traffic from pods in all namespaces"),
         step([create(policy("x", "allow-from-another-ns", ml(pod="a"),
                             ingress=[{"from": [{"namespaceSelector": {"matchLabels": {}}}]}],
                             types=["Ingress"]))],
              R().probe(80))),
    case("ingress-nsselector-other-ns",
         t("should enforce policy to allow traffic only from a different namespace, based on NamespaceSelector"),
         step([create(policy("x", "allow-client-a-via-ns-selector", ml(pod="a"),
                             ingress=[{"from": [{"namespaceSelector": nsname("y")}]}], types=["Ingress"]))],
              R().peer(["x", "z"], "x/a", False).probe(80))),
    case("ingress-podselector-matchexpressions",
         t("should enforce policy based on PodSelector with MatchExpressions"),
         step([create(policy("x", "x-a-allows-x-b", ml(pod="a"),
                             ingress=[{"from": [{"podSelector": expr("pod", "In", ["b"])}]}],
                             types=["Ingress"]))],
              R().ingress("x/a", False).peer("x/b", "x/a", True).probe(80))),
    case("ingress-nsselector-matchexpressions",
         t("should enforce policy based on NamespaceSelector with MatchExpressions"),
         step([create(policy("x", "allow-ns-y-match-selector", ml(pod="a"),
                             ingress=[{"from": [{"namespaceSelector": expr(MD, "In", ["y"])}]}],
                             types=["Ingress"]))],
              R().peer(["x", "z"], "x/a", False).probe(80))),
    case("ingress-podselector-or-nsselector",
         t("should enforce policy based on PodSelector or NamespaceSelector"),
         step([create(policy("x", "allow-ns-y-match-selector", ml(pod="a"),
                             ingress=[{"from": [{"namespaceSelector": expr(MD, "NotIn", ["x"])},
                                                {"podSelector": ml(pod="b")}]}],
                             types=["Ingress"]))],
              R().peer(["x/a", "x/c"], "x/a", False).probe(80))),
    case("ingress-podselector-and-nsselector",
         t("should enforce policy based on PodSelector and NamespaceSelector"),
         step([create(policy("x", "allow-ns-y-podselector-and-nsselector", ml(pod="a"),
                             ingress=[{"from": [{"namespaceSelector": expr(MD, "NotIn", ["x"]),
                                                 "podSelector": ml(pod="b")}]}],
                             types=["Ingress"]))],
              R().ingress("x/a", False).peer(["y/b", "z/b"], "x/a", True).probe(80))),
    case("ingress-multiple-pod-and-ns-selectors",
         t("should enforce policy based on Multiple PodSelectors and NamespaceSelectors"),
         step([create(policy("x", "allow-ns-y-z-pod-b-c", ml(pod="a"),
                             ingress=[{"from": [{"namespaceSelector": expr(MD, "NotIn", ["x"]),
                                                 "podSelector": expr("pod", "In", ["b", "c"])}]}],
                             types=["Ingress"]))],
              R().ingress("x/a", False).peer(["y/b", "y/c", "z/b", "z/c"], "x/a", True).probe(80))),
    case("ingress-any-podselectors", t("should enforce policy based on any PodSelectors"),
         step([create(policy("x", "allow-ns-x-pod-b-c", ml(pod="a"),
                             ingress=[{"from": [{"podSelector": ml(pod="b")},
                                                {"podSelector": ml(pod="c")}]}],
                             types=["Ingress"]))],
              R().ingress("x/a", False).peer(["x/b", "x/c"], "x/a", True).probe(80))),
    case("ingress-pod-in-other-ns",
         t("should enforce policy to allow traffic only from a pod in a different namespace based on PodSelector and NamespaceSelector"),
         step([create(policy("x", "allow-ns-y-pod-a-via-namespace-pod-selector", ml(pod="a"),
                             ingress=[{"from": [{"namespaceSelector": nsname("y"),
                                                 "podSelector": ml(pod="a")}]}],
                             types=["Ingress"]))],
              R().ingress("x/a", False).peer("y/a", "x/a", True).probe(80))),
    case("ingress-updated-namespace", t("should allow ingress access from updated namespace"),
         step([create(policy("x", "allow-client-a-via-ns-selector", ml(pod="a"),
                             ingress=[{"from": [{"namespaceSelector": ml(ns2="updated")}]}],
                             types=["Ingress"]))],
              R().ingress("x/a", False).probe(80)),
         step([{"add_namespace_labels": {"namespace": "y", "labels": {"ns2": "updated"}}}],
              R().ingress("x/a", False).peer("y", "x/a", True).probe(80))),
    case("ingress-updated-pod", t("should allow ingress access from updated pod"),
         step([create(policy("x", "allow-client-a-via-pod-selector", ml(pod="a"),
                             ingress=[{"from": [{"podSelector": ml(pod="b", pod2="updated")}]}],
                             types=["Ingress"]))],
              R().ingress("x/a", False).probe(80)),
         step([{"add_pod_labels": {"pod": "x/b", "labels": {"pod2": "updated"}}}],
              R().ingress("x/a", False).peer("x/b", "x/a", True).probe(80))),
    case("ingress-deny-other-namespaces", t("should deny ingress from pods on other namespaces"),
         step([create(policy("x", "deny-empty-policy", {},
                             ingress=[{"from": [{"podSelector": {"matchLabels": {}}}]}],
                             types=["Ingress"]))],
              R().peer(["y", "z"], "x", False).probe(80))),
    case("ingress-deny-updated-pod", t("should deny ingress access to updated pod"),
         step([create(policy("x", "deny-ingress-via-label-selector", ml(target="isolated"),
                             types=["Ingress"]))],
              R().probe(80)),
         step([{"add_pod_labels": {"pod": "x/a", "labels": {"target": "isolated"}}}],
              R().ingress("x/a", False).probe(80))),
    case("ingress-allow-all", t("should support allow-all policy"),
         step([create(policy("x", "allow-all", ml(), ingress=[{}], types=["Ingress"]))],
              R().probe(80), R().probe(81))),
    case("ingress-updated-policy", t("should enforce updated policy"),
         step([create(policy("x", "allow-all-mutate-to-deny-all", ml(), ingress=[{}], types=["Ingress"]))],
              R().probe(81)),
         step([update(policy("x", "allow-all-mutate-to-deny-all", ml(), ingress=[], types=["Ingress"]))],
              R().ingress("x", False).probe(81))),
    case("ingress-allow-all-precedence",
         t("should enforce multiple ingress policies with ingress allow-all policy taking precedence"),
         step([create(policy("x", "allow-ingress-port-80", ml(), ingress=[{"ports": [port(80)]}],
                             types=["Ingress"]))],
              R().ingress("x", False).probe(81), R().probe(80)),
         step([create(policy("x", "allow-ingress", ml(), ingress=[{}], types=["Ingress"]))],
              R().probe(81))),
    case("ingress-stop-after-delete", t("should stop enforcing policies after they are deleted"),
         step([create(policy("x", "deny-all", {}, types=["Ingress", "Egress"]))],
              R().ingress("x", False).egress("x", False).probe(80)),
         step([{"delete_all_policies": {}}], R().probe(80))),
    case("ingress-egress-independent",
         t("should enforce policies to check ingress and egress policies can be controlled independently based on PodSelector"),
         step([create(policy("x", "allow-egress-for-target", ml(pod="a"), egress=[{}], types=["Egress"]))],
              R().probe(80)),
         step([create(policy("x", "deny-ingress-via-label-selector", ml(pod="a"), types=["Ingress"]))],
              R().ingress("x/a", False).probe(80))),
    case("ingress-default-ns-label-matchlabels",
         t("should enforce policy to allow traffic based on NamespaceSelector with MatchLabels using default ns label"),
         step([create(policy("x", "allow-client-a-via-ns-selector-for-immutable-ns-label", ml(pod="a"),
                             ingress=[{"from": [{"namespaceSelector": nsname("y")}]}], types=["Ingress"]))],
              R().peer(["x", "z"], "x/a", False).probe(80))),
]

# ---------------------------------------------------------------- egress
egress_cases = [
    case("egress-deny-podselector", t("should deny egress from pods based on PodSelector"),
         step([create(policy("x", "deny-egress-pod-a", ml(pod="a"), types=["Egress"]))],
              R().egress("x/a", False).probe(80))),
    case("egress-deny-namespace", t("should deny egress from all pods in a namespace"),
         step([create(policy("x", "deny-egress-ns-x", {}, types=["Egress"]))],
              R().egress("x", False).probe(80))),
    case("egress-ingress-together", t("should work with Ingress, Egress specified together"),
         step([create(policy("x", "allow-client-a-via-pod-selector", ml(pod="a"),
                             ingress=[{"from": [{"podSelector": ml(pod="b")}]}],
                             egress=[{"ports": [port(80)]}], types=["Egress", "Ingress"]))],
              R().ingress("x/a", False).peer("x/b", "x/a", True).probe(80),
              R().ingress("x/a", False).egress("x/a", False).peer("x/b", "x/a", True).probe(81))),
    case("egress-client-side-deny",
         t("should support denying of egress traffic on the client side (even if the server explicitly allows this traffic)"),
         step([create(policy("x", "allow-to-ns-y-pod-a", ml(pod="a"),
                             egress=[{"to": [{"namespaceSelector": nsname("y"), "podSelector": ml(pod="a")}]}],
                             types=["Egress"])),
               create(policy("y", "allow-from-xa-on-ya-match-selector", ml(pod="a"),
                             ingress=[{"from": [{"namespaceSelector": nsname("x"), "podSelector": ml(pod="a")}]}],
                             types=["Ingress"])),
               create(policy("y", "allow-from-xa-on-yb-match-selector", ml(pod="b"),
                             ingress=[{"from": [{"namespaceSelector": nsname("x"), "podSelector": ml(pod="a")}]}],
                             types=["Ingress"]))],
              R().egress("x/a", False).ingress("y/a", False).peer("x/a", "y/a", True)
              .ingress("y/b", False).probe(80))),
    case("egress-pod-in-other-ns",
         t("should enforce egress policy allowing traffic to a server in a different namespace based on PodSelector and NamespaceSelector"),
         step([create(policy("x", "allow-to-ns-y-pod-a", ml(pod="a"),
                             egress=[{"to": [{"namespaceSelector": nsname("y"), "podSelector": ml(pod="a")}]}],
                             types=["Egress"]))],
              R().egress("x/a", False).peer("x/a", "y/a", True).probe(80))),
    case("egress-allow-all-precedence",
         t("should enforce multiple egress policies with egress allow-all policy taking precedence"),
         step([create(policy("x", "allow-egress-port-80", ml(), egress=[{"ports": [port(80)]}],
                             types=["Egress"]))],
              R().egress("x", False).probe(81), R().probe(80)),
         step([create(policy("x", "allow-egress", ml(), egress=[{}], types=["Egress"]))],
              R().probe(81))),
    case("egress-default-ns-label-matchexpressions",
         t("should enforce policy based on NamespaceSelector with MatchExpressions using default ns label"),
         step([create(policy("x", "allow-ns-y-match-selector-for-immutable-ns-label", ml(pod="a"),
                             egress=[{"to": [{"namespaceSelector": expr(MD, "NotIn", ["y"])}]}],
                             types=["Egress"]))],
              R().peer("x/a", "y", False).probe(80))),
]

# ---------------------------------------------------------------- ports / protocols
ports_cases = [
    case("ports-ingress-81-from-ns", t("should enforce policy based on Ports"),
         step([create(policy("x", "allow-client-a-via-ns-selector", ml(pod="a"),
                             ingress=[{"from": [{"namespaceSelector": nsname("y")}],
                                       "ports": [port(81, "TCP")]}], types=["Ingress"]))],
              R().peer(["x", "z"], "x/a", False).probe(81),
              R().ingress("x/a", False).probe(80))),
    case("ports-stacked-policies", t("should enforce multiple, stacked policies with overlapping podSelectors"),
         step([create(policy("x", "allow-client-a-via-ns-selector", ml(pod="a"),
                             ingress=[{"from": [{"namespaceSelector": nsname("y")}],
                                       "ports": [port(81, "TCP")]}], types=["Ingress"]))],
              R().peer(["x", "z"], "x/a", False).probe(81),
              R().ingress("x/a", False).probe(80)),
         step([create(policy("x", "allow-client-a-via-ns-selector-80", ml(pod="a"),
                             ingress=[{"from": [{"namespaceSelector": nsname("y")}],
                                       "ports": [port(80, "TCP")]}], types=["Ingress"]))],
              R().peer(["x", "z"], "x/a", False).probe(80),
              R().peer(["x", "z"], "x/a", False).probe(81))),
    case("ports-named-ingress", t("should allow ingress access on one named port"),
         step([create(policy("x", "allow-all", ml(), ingress=[{"ports": [port("serve-81-tcp")]}],
                             types=["Ingress"]))],
              R().probe(81), R().ingress("x", False).probe(80))),
    case("ports-named-ingress-from-ns", t("should allow ingress access from namespace on one named port"),
         step([create(policy("x", "allow-client-a-via-ns-selector-80", ml(pod="a"),
                             ingress=[{"from": [{"namespaceSelector": nsname("y")}],
                                       "ports": [port("serve-80-tcp", "TCP")]}], types=["Ingress"]))],
              R().peer(["x", "z"], "x/a", False).probe(80),
              R().ingress("x/a", False).probe(81))),
    case("ports-named-egress", t("should allow egress access on one named port"),
         step([create(policy("x", "allow-egress", ml(), egress=[{"ports": [port("serve-80-tcp")]}],
                             types=["Egress"]))],
              R().probe(80), R().egress("x", False).probe(81))),
    case("ports-protocol-only", t("should enforce ingress policy allowing any port traffic to a server on a specific protocol"),
         step([create(policy("x", "allow-ingress-by-proto", ml(pod="a"),
                             ingress=[{"ports": [port(proto="TCP")]}], types=["Ingress"]))],
              R().probe(80), R().probe(81), R().ingress("x/a", False).probe(80, "UDP"))),
    case("ports-sctp-not-tcp",
         t("should not mistakenly treat 'protocol: SCTP' as 'protocol: TCP', even if the plugin doesn't support SCTP"),
         step([create(policy("x", "deny-ingress", {}, types=["Ingress"])),
               create(policy("x", "allow-only-sctp-ingress-on-port-81", ml(pod="a"),
                             ingress=[{"ports": [port(81, "SCTP")]}], types=["Ingress"]))],
              R().ingress("x", False).probe(81),
              R().ingress(["x/b", "x/c"], False).probe(81, "SCTP"))),
    case("ports-sctp-isolates",
         t("should properly isolate pods that are selected by a policy allowing SCTP, even if the plugin doesn't support SCTP"),
         step([create(policy("x", "allow-only-sctp-ingress-on-port-80", ml(pod="a"),
                             ingress=[{"ports": [port(80, "SCTP")]}], types=["Ingress"]))],
              R().ingress("x/a", False).probe(81),
              R().ingress("x/a", False).probe(80),
              R().probe(80, "SCTP"))),
    case("ports-udp-not-tcp", t("should not allow access by TCP when a policy specifies only UDP"),
         step([create(policy("x", "allow-only-udp-ingress-on-port-81", ml(pod="a"),
                             ingress=[{"ports": [port(81, "UDP")]}], types=["Ingress"]))],
              R().ingress("x/a", False).probe(81),
              R().probe(81, "UDP"))),
    # UDP context
    case("udp-default-deny-ingress", t("should support a 'default-deny-ingress' policy", UP_UDP),
         step([create(policy("x", "deny-all", {}, types=["Ingress"]))],
              R().ingress("x", False).probe(80, "UDP"))),
    case("udp-ports", t("should enforce policy based on Ports", UP_UDP),
         step([create(policy("x", "allow-ingress-on-port-81-ns-x", ml(pod="a"),
                             ingress=[{"from": [{"namespaceSelector": nsname("y")}],
                                       "ports": [port(81, "UDP")]}], types=["Ingress"]))],
              R().peer(["x", "z"], "x/a", False).probe(81, "UDP"),
              R().ingress("x/a", False).probe(81, "TCP"))),
    case("udp-pod-in-other-ns",
         t("should enforce policy to allow traffic only from a pod in a different namespace based on PodSelector and NamespaceSelector", UP_UDP),
         step([create(policy("x", "allow-ns-y-pod-a-via-namespace-pod-selector", ml(pod="a"),
                             ingress=[{"from": [{"namespaceSelector": nsname("y"),
                                                 "podSelector": ml(pod="a")}]}], types=["Ingress"]))],
              R().ingress("x/a", False).peer("y/a", "x/a", True).probe(80, "UDP"))),
    # SCTP context
    case("sctp-default-deny-ingress", t("should support a 'default-deny-ingress' policy", UP_SCTP),
         step([create(policy("x", "deny-all", {}, types=["Ingress"]))],
              R().ingress("x", False).probe(80, "SCTP"))),
    case("sctp-ports", t("should enforce policy based on Ports", UP_SCTP),
         step([create(policy("x", "allow-ingress-on-port-81-ns-x", ml(pod="a"),
                             ingress=[{"from": [{"namespaceSelector": nsname("y")}],
                                       "ports": [port(81, "SCTP")]}], types=["Ingress"]))],
              R().peer(["x", "z"], "x/a", False).probe(81, "SCTP"),
              R().ingress("x/a", False).probe(80, "SCTP"))),
    case("sctp-pod-in-other-ns",
         t("should enforce policy to allow traffic only from a pod in a different namespace based on PodSelector and NamespaceSelector", UP_SCTP),
         step([create(policy("x", "allow-ns-y-pod-a-via-namespace-pod-selector", ml(pod="a"),
                             ingress=[{"from": [{"namespaceSelector": nsname("y"),
                                                 "podSelector": ml(pod="a")}]}], types=["Ingress"]))],
              R().ingress("x/a", False).peer("y/a", "x/a", True).probe(80, "SCTP"))),
]

# ---------------------------------------------------------------- ipBlock
ipblock_cases = [
    case("ipblock-egress-pod-cidr", t("should allow egress access to server in CIDR block"),
         step([create(policy("x", "allow-client-a-via-cidr-egress-rule", ml(pod="a"),
                             egress=[{"to": [{"ipBlock": {"cidr": "${CIDR32:y/b}"}}]}], types=["Egress"]))],
              R().egress("x/a", False).peer("x/a", "y/b", True).probe(80))),
    case("ipblock-egress-except", t("should enforce except clause while egress access to server in CIDR block"),
         step([create(policy("x", "allow-client-a-via-cidr-egress-rule", ml(pod="a"),
                             egress=[{"to": [{"ipBlock": {"cidr": "${CIDR4:x/b}",
                                                          "except": ["${CIDR32:x/b}"]}}]}],
                             types=["Egress"]))],
              R().peer("x/a", "x/b", False).probe(80))),
    case("ipblock-egress-except-then-update",
         t("should ensure an IP overlapping both IPBlock.CIDR and IPBlock.Except is allowed"),
         step([create(policy("x", "allow-client-a-via-cidr-egress-rule", ml(pod="a"),
                             egress=[{"to": [{"ipBlock": {"cidr": "${CIDR4:x/b}",
                                                          "except": ["${CIDR32:x/b}"]}}]}],
                             types=["Egress"]))],
              R().peer("x/a", "x/b", False).probe(80)),
         # upstream replaces the policy (same name) with one that allows only x/b
         step([update(policy("x", "allow-client-a-via-cidr-egress-rule", ml(pod="a"),
                             egress=[{"to": [{"ipBlock": {"cidr": "${CIDR32:x/b}"}}]}], types=["Egress"]))],
              R().egress("x/a", False).peer("x/a", "x/b", True).probe(80))),
    # extras
    case("ipblock-except-union",
         "extra: an IP excepted by one policy's ipBlock is still allowed by another policy (union; the intent of the upstream overlap case)",
         step([create(policy("x", "cidr-except-xb", ml(pod="a"),
                             egress=[{"to": [{"ipBlock": {"cidr": "${CIDR4:x/b}",
                                                          "except": ["${CIDR32:x/b}"]}}]}],
                             types=["Egress"]))],
              R().peer("x/a", "x/b", False).probe(80)),
         step([create(policy("x", "cidr-xb", ml(pod="a"),
                             egress=[{"to": [{"ipBlock": {"cidr": "${CIDR32:x/b}"}}]}], types=["Egress"]))],
              R().probe(80))),
    case("ipblock-ingress-except-namespace",
         "extra: ingress ipBlock with an except entry covering a whole namespace's addresses",
         step([create(policy("x", "from-cidr-except-y", ml(pod="a"),
                             ingress=[{"from": [{"ipBlock": {"cidr": "${CIDR16:x/a}",
                                                             "except": ["${CIDR24:y/a}"]}}]}],
                             types=["Ingress"]))],
              R().peer("y", "x/a", False).probe(80))),
    case("ipblock-ingress-pod-ip",
         "extra: ingress ipBlock /32 (/128) of one pod's IP",
         step([create(policy("x", "from-zc", ml(pod="a"),
                             ingress=[{"from": [{"ipBlock": {"cidr": "${CIDR32:z/c}"}}]}],
                             types=["Ingress"]))],
              R().ingress("x/a", False).peer("z/c", "x/a", True).probe(80),
              R().ingress("x/a", False).peer("z/c", "x/a", True).probe(81, "UDP"))),
    case("ipblock-ingress-everything",
         "extra: an ipBlock containing every pod matches pods too",
         step([create(policy("x", "deny-ingress", {}, types=["Ingress"])),
               create(policy("x", "from-everything", ml(pod="b"),
                             ingress=[{"from": [{"ipBlock": {"cidr": "${CIDR0:x/a}"}}]}],
                             types=["Ingress"]))],
              R().ingress(["x/a", "x/c"], False).probe(80))),
    case("ipblock-egress-except-with-port",
         "extra: egress ipBlock with except plus a port restriction",
         step([create(policy("x", "to-cidr-port-81", ml(pod="a"),
                             egress=[{"to": [{"ipBlock": {"cidr": "${CIDR16:z/a}",
                                                          "except": ["${CIDR24:z/a}"]}}],
                                      "ports": [port(81, "TCP")]}],
                             types=["Egress"]))],
              R().egress("x/a", False).probe(80),
              R().egress("x/a", False).peer("x/a", ["x", "y"], True).probe(81))),
]

# ---------------------------------------------------------------- extra
extra_cases = [
    case("endport-ingress-range", "extra: endPort range on ingress (port..endPort inclusive)",
         step([create(policy("x", "range-81-90", ml(pod="a"),
                             ingress=[{"ports": [port(81, "TCP", 90)]}], types=["Ingress"]))],
              R().ingress("x/a", False).probe(80), R().probe(81)),
         step([update(policy("x", "range-81-90", ml(pod="a"),
                             ingress=[{"ports": [port(75, "TCP", 80)]}], types=["Ingress"]))],
              R().probe(80), R().ingress("x/a", False).probe(81))),
    case("endport-egress-range-udp", "extra: endPort range on egress, UDP",
         step([create(policy("x", "udp-79-80", {}, egress=[{"ports": [port(79, "UDP", 80)]}],
                             types=["Egress"]))],
              R().probe(80, "UDP"), R().egress("x", False).probe(81, "UDP"),
              R().egress("x", False).probe(80, "TCP"))),
    case("named-port-wrong-protocol", "extra: a named port whose name exists only with another protocol matches nothing",
         step([create(policy("x", "named-udp-as-tcp", ml(pod="a"),
                             ingress=[{"ports": [port("serve-80-udp", "TCP")]}], types=["Ingress"]))],
              R().ingress("x/a", False).probe(80),
              R().ingress("x/a", False).probe(80, "UDP")),
         step([update(policy("x", "named-udp-as-tcp", ml(pod="a"),
                             ingress=[{"ports": [port("serve-80-udp", "UDP")]}], types=["Ingress"]))],
              R().ingress("x/a", False).probe(80),
              R().probe(80, "UDP"))),
    case("named-port-egress-udp", "extra: an egress named port resolved on the destination pods, UDP",
         step([create(policy("x", "egress-serve-81-udp", ml(pod="a"),
                             egress=[{"ports": [port("serve-81-udp", "UDP")]}], types=["Egress"]))],
              R().probe(81, "UDP"),
              R().egress("x/a", False).probe(81, "TCP"),
              R().egress("x/a", False).probe(80, "UDP"))),
    case("defaulting-egress-rules-without-policytypes",
         "extra: egress rules without policyTypes default to [Ingress, Egress] (ingress isolated too)",
         step([create(policy("x", "egress-to-y", ml(pod="a"),
                             egress=[{"to": [{"namespaceSelector": nsname("y")}]}]))],
              R().ingress("x/a", False).egress("x/a", False).peer("x/a", "y", True).probe(80))),
    case("defaulting-empty-egress-without-policytypes",
         "extra: `egress: []` without policyTypes is an ingress-only policy",
         step([create(policy("x", "deny-in", {}, egress=[]))],
              R().ingress("x", False).probe(80))),
    case("label-pod-unselected", "extra: removing the label that selects a pod lifts its isolation",
         step([create(policy("x", "deny-a", ml(pod="a"), types=["Ingress"]))],
              R().ingress("x/a", False).probe(80)),
         step([{"set_pod_labels": {"pod": "x/a", "labels": {"app": "other"}}}],
              R().probe(80))),
    case("label-namespace-peer-removed", "extra: namespace labels added then removed change a namespaceSelector peer",
         step([create(policy("x", "from-blue", ml(pod="a"),
                             ingress=[{"from": [{"namespaceSelector": ml(team="blue")}]}],
                             types=["Ingress"])),
               {"add_namespace_labels": {"namespace": "y", "labels": {"team": "blue"}}}],
              R().ingress("x/a", False).peer("y", "x/a", True).probe(80)),
         step([{"set_namespace_labels": {"namespace": "y", "labels": {}}}],
              R().ingress("x/a", False).probe(80)),
         step([{"add_namespace_labels": {"namespace": "z", "labels": {"team": "blue"}}}],
              R().ingress("x/a", False).peer("z", "x/a", True).probe(80))),
    case("label-pod-peer-changes", "extra: a peer pod's label changes move it in and out of a podSelector",
         step([create(policy("x", "from-clients", ml(pod="a"),
                             ingress=[{"from": [{"podSelector": ml(role="client")}]}], types=["Ingress"])),
               {"add_pod_labels": {"pod": "x/c", "labels": {"role": "client"}}}],
              R().ingress("x/a", False).peer("x/c", "x/a", True).probe(80)),
         step([{"add_pod_labels": {"pod": "x/c", "labels": {"role": "server"}}},
               {"add_pod_labels": {"pod": "x/b", "labels": {"role": "client"}}}],
              R().ingress("x/a", False).peer("x/b", "x/a", True).probe(80))),
    case("selector-notin-absent-key", "extra: NotIn matches pods without the key; Exists matches an empty value",
         step([create(policy("x", "not-prod", ml(pod="a"),
                             ingress=[{"from": [{"podSelector": expr("env", "NotIn", ["prod"])}]}],
                             types=["Ingress"]))],
              R().peer(["y", "z"], "x/a", False).probe(80)),
         step([{"add_pod_labels": {"pod": "x/b", "labels": {"env": "prod"}}}],
              R().peer(["y", "z", "x/b"], "x/a", False).probe(80)),
         step([update(policy("x", "not-prod", ml(pod="a"),
                             ingress=[{"from": [{"podSelector": expr("env", "Exists")}]}],
                             types=["Ingress"])),
               {"add_pod_labels": {"pod": "x/c", "labels": {"env": ""}}}],
              R().ingress("x/a", False).peer(["x/b", "x/c"], "x/a", True).probe(80)),
         step([update(policy("x", "not-prod", ml(pod="a"),
                             ingress=[{"from": [{"podSelector": expr("env", "DoesNotExist")}]}],
                             types=["Ingress"]))],
              R().ingress("x/a", False).peer("x/a", "x/a", True).probe(80))),
    case("pod-created-isolated", "extra: a pod created mid-case in an isolated namespace is isolated",
         step([create(policy("x", "deny-ingress", {}, types=["Ingress"]))],
              R().ingress("x", False).probe(80)),
         step([{"create_pod": {"pod": "x/d", "labels": {"pod": "d"}}}],
              R(["x/a", "x/b", "x/d", "y/a"]).ingress("x", False).probe(80),
              R(["x/a", "x/b", "x/d", "y/a"]).ingress("x", False).probe(81, "UDP"))),
    case("pod-created-peer", "extra: a pod created mid-case becomes an allowed peer",
         step([create(policy("x", "from-d", ml(pod="a"),
                             ingress=[{"from": [{"podSelector": ml(pod="d")}]}], types=["Ingress"]))],
              R().ingress("x/a", False).probe(80)),
         step([{"create_pod": {"pod": "x/d", "labels": {"pod": "d"}}}],
              R(["x/a", "x/b", "x/d", "y/a"]).ingress("x/a", False).peer("x/d", "x/a", True).probe(80)),
         step([{"delete_pod": {"pod": "x/d"}}],
              R(["x/a", "x/b", "y/a"]).ingress("x/a", False).probe(80))),
    case("pod-deleted-recreated", "extra: a pod deleted and created again keeps its policy role",
         step([create(policy("x", "from-b", ml(pod="a"),
                             ingress=[{"from": [{"podSelector": ml(pod="b")}]}], types=["Ingress"])),
               {"delete_pod": {"pod": "x/b"}}],
              R(["x/a", "x/c", "y/a"]).ingress("x/a", False).probe(80)),
         step([{"create_pod": {"pod": "x/b", "labels": {"pod": "b"}}}],
              R().ingress("x/a", False).peer("x/b", "x/a", True).probe(80))),
    case("namespace-created-mid-case", "extra: a namespace and a pod created mid-case are selected by a namespaceSelector",
         step([create(policy("x", "from-new-team", ml(pod="a"),
                             ingress=[{"from": [{"namespaceSelector": ml(team="new")}]}],
                             types=["Ingress"]))],
              R().ingress("x/a", False).probe(80)),
         step([{"create_namespace": {"namespace": "w", "labels": {"team": "new"}}},
               {"create_pod": {"pod": "w/a", "labels": {"pod": "a"}}}],
              R(["x/a", "x/b", "y/a", "w/a"]).ingress("x/a", False).peer("w/a", "x/a", True).probe(80)),
         step([{"set_namespace_labels": {"namespace": "w", "labels": {}}}],
              R(["x/a", "x/b", "y/a", "w/a"]).ingress("x/a", False).probe(80))),
    case("namespace-created-isolated", "extra: a policy in a namespace created mid-case isolates its pods",
         step([{"create_namespace": {"namespace": "w", "labels": {}}},
               {"create_pod": {"pod": "w/a", "labels": {"pod": "a"}}},
               create(policy("w", "deny-all", {}, types=["Ingress", "Egress"]))],
              R(["x/a", "y/a", "w/a"]).ingress("w", False).egress("w", False).probe(80)),
         step([{"delete_namespace": {"namespace": "w"}}],
              R(["x/a", "y/a", "z/a"]).probe(80))),
    case("egress-to-ingress-isolated-both", "extra: both sides must allow: egress allowed but ingress denied, and the reverse",
         step([create(policy("x", "egress-to-y", ml(pod="a"),
                             egress=[{"to": [{"namespaceSelector": nsname("y")}]}], types=["Egress"])),
               create(policy("y", "from-x-b", {},
                             ingress=[{"from": [{"namespaceSelector": nsname("x"), "podSelector": ml(pod="b")}]}],
                             types=["Ingress"]))],
              R().egress("x/a", False).ingress("y", False).peer("x/b", "y", True).probe(80))),
]

FILES = {
    "upstream-ingress.yaml": ingress_cases,
    "upstream-egress.yaml": egress_cases,
    "upstream-ports.yaml": ports_cases,
    "upstream-ipblock.yaml": ipblock_cases,
    "extra.yaml": extra_cases,
}


def main():
    try:
        import yaml
    except ImportError:
        print("needs PyYAML (pip install pyyaml)", file=sys.stderr)
        return 1
    seen = set()
    for fname, cases in FILES.items():
        for c in cases:
            assert c["id"] not in seen, c["id"]
            seen.add(c["id"])
        header = (
            "# Generated by tests/conformance/gen/catalogue.py: edit the generator, not this file.\n"
            "# Expected matrices: rows = source pod, columns = `pods` (default x/a..z/c), 1 = connects.\n"
        )
        with open(os.path.join(OUT, fname), "w") as f:
            f.write(header)
            yaml.safe_dump({"cases": cases}, f, sort_keys=False, width=200, default_flow_style=False)
    print(f"{len(seen)} cases in {len(FILES)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
