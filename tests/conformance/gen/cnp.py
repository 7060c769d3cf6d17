#!/usr/bin/env python3
"""Generates the ClusterNetworkPolicy conformance cases (tests/conformance/cnp-*.yaml).

The upstream suite is kubernetes-sigs/network-policy-api `conformance/tests/*.go`
(the v1alpha2 ClusterNetworkPolicy tests, bundle v0.2.0) with the policies of
`conformance/base/{admin_tier,baseline_tier,api_integration}/*.yaml`. Each upstream
test becomes one case on the `network-policy-api` topology (four houses, two pods
each); each of its `t.Run` subtests becomes one step, in order, because upstream
subtests share the cluster: a rule swap made by one subtest is still in place for
the next. A mutation becomes an `update_cluster_network_policy` with the whole
resulting object. Each upstream `PokeServer(client, proto, server, port, expect)`
becomes one cell of a probe (rows: clients, `pods`: the server), with the upstream
expectation: these cases check exactly what upstream checks, no more.

Where the upstream code and its comments or rule names disagree, the cases follow the
code (the objects the test applies and the expectations it asserts): listed in NOTES.

Run: python3 tests/conformance/gen/cnp.py (needs PyYAML).
"""

import copy
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.dirname(HERE)

SRC = "kubernetes-sigs/network-policy-api conformance/tests"
HOUSE_OF = {
    "harry-potter": "gryffindor",
    "draco-malfoy": "slytherin",
    "cedric-diggory": "hufflepuff",
    "luna-lovegood": "ravenclaw",
    "centaur": "forbidden-forrest",
}

# Upstream's HostNetworkPorts (the suite's default range, 34345..34352).
HNP = [34345 + i for i in range(8)]


def ns(house):
    return f"network-policy-conformance-{house}"


def pod(name):
    """`harry-potter-0` -> `network-policy-conformance-gryffindor/harry-potter-0`."""
    return f"{ns(HOUSE_OF[name.rsplit('-', 1)[0]])}/{name}"


def by_name(house):
    """A namespace selector on the metadata-name label."""
    return {"namespaces": {"matchLabels": {"kubernetes.io/metadata.name": ns(house)}}}


def by_house(house):
    """A namespace selector on the `conformance-house` label."""
    return {"namespaces": {"matchLabels": {"conformance-house": house}}}


def pods_of(house):
    """A pods selector: namespaces and pods labelled `conformance-house: house`."""
    sel = {"matchLabels": {"conformance-house": house}}
    return {"pods": {"namespaceSelector": copy.deepcopy(sel), "podSelector": copy.deepcopy(sel)}}


def proto(p, number):
    return {p: {"destinationPort": {"number": number}}}


def rule(name, action, peers, direction, protocols=None):
    r = {"name": name, "action": action, ("from" if direction == "ingress" else "to"): peers}
    if protocols:
        r["protocols"] = protocols
    return r


def cnp(name, tier, priority, subject, ingress=None, egress=None):
    spec = {"tier": tier, "priority": priority, "subject": subject}
    if ingress is not None:
        spec["ingress"] = ingress
    if egress is not None:
        spec["egress"] = egress
    return {
        "apiVersion": "policy.networking.k8s.io/v1alpha2",
        "kind": "ClusterNetworkPolicy",
        "metadata": {"name": name},
        "spec": spec,
    }


# --- the base policies (conformance/base) -------------------------------------------


def single_proto(name, tier, priority, subject_house, direction, p, peers, ports, with_pass):
    """The shape shared by the {admin,baseline} {ingress,egress} {tcp,udp,sctp} policies.

    `peers` = (everything-house, port-house, accept-house); `ports` = (deny/pass port,
    accept port). Admin: accept, deny, pass everything from/to the first house; deny and
    pass the second at a port; accept the third at a port, deny the rest of it.
    Baseline has no Pass rules.
    """
    a, b, c = peers
    deny_port, accept_port = ports
    frm = "from" if direction == "ingress" else "to"
    rules = [
        rule(f"allow-{frm}-{a}-everything", "Accept", [by_name(a)], direction),
        rule(f"deny-{frm}-{a}-everything", "Deny", [by_name(a)], direction),
    ]
    if with_pass:
        rules.append(rule(f"pass-{frm}-{a}-everything", "Pass", [by_name(a)], direction))
    rules.append(rule(f"deny-{frm}-{b}-at-port-{deny_port}", "Deny", [by_name(b)], direction, [proto(p, deny_port)]))
    if with_pass:
        rules.append(rule(f"pass-{frm}-{b}-at-port-{deny_port}", "Pass", [by_name(b)], direction, [proto(p, deny_port)]))
    rules.append(rule(f"allow-{frm}-{c}-at-port-{accept_port}", "Accept", [by_name(c)], direction, [proto(p, accept_port)]))
    rules.append(rule(f"deny-{frm}-{c}-everything-else", "Deny", [by_name(c)], direction))
    return cnp(name, tier, priority, by_name(subject_house), **{direction: rules})


# (subject house, (everything, at-port, accept-at-port houses), (deny port, accept port))
SHAPES = {
    ("ingress", "tcp"): ("gryffindor", ("ravenclaw", "slytherin", "hufflepuff"), (80, 80)),
    ("ingress", "udp"): ("hufflepuff", ("ravenclaw", "slytherin", "gryffindor"), (5353, 53)),
    ("ingress", "sctp"): ("ravenclaw", ("gryffindor", "slytherin", "hufflepuff"), (9003, 9003)),
    ("egress", "tcp"): ("gryffindor", ("ravenclaw", "slytherin", "hufflepuff"), (80, 8080)),
    ("egress", "udp"): ("hufflepuff", ("ravenclaw", "slytherin", "gryffindor"), (5353, 53)),
    ("egress", "sctp"): ("ravenclaw", ("gryffindor", "slytherin", "hufflepuff"), (9003, 9003)),
}
ADMIN_PRIORITY = {
    ("ingress", "tcp"): 3,
    ("ingress", "udp"): 4,
    ("ingress", "sctp"): 5,
    ("egress", "tcp"): 6,
    ("egress", "udp"): 7,
    ("egress", "sctp"): 8,
}


def single(tier, direction, p):
    subject, peers, ports = SHAPES[(direction, p)]
    if tier == "Admin":
        name, prio = f"{direction}-{p}", ADMIN_PRIORITY[(direction, p)]
    else:
        name, prio = "default", 10
    return single_proto(name, tier, prio, subject, direction, p, peers, ports, tier == "Admin")


def gress(tier):
    """standard-gress-rules-combined.yaml: both directions, three protocols per port rule."""
    admin = tier == "Admin"
    p3 = lambda t, u, s: [proto("tcp", t), proto("udp", u), proto("sctp", s)]  # noqa: E731
    eg = [
        rule("allow-to-ravenclaw-everything", "Accept", [by_name("ravenclaw")], "egress"),
        rule("deny-to-ravenclaw-everything", "Deny", [by_name("ravenclaw")], "egress"),
    ]
    ing = [
        rule("allow-from-ravenclaw-everything", "Accept", [by_name("ravenclaw")], "ingress"),
        rule("deny-from-ravenclaw-everything", "Deny", [by_name("ravenclaw")], "ingress"),
    ]
    if admin:
        eg.append(rule("pass-to-ravenclaw-everything", "Pass", [by_name("ravenclaw")], "egress"))
        ing.append(rule("pass-from-ravenclaw-everything", "Pass", [by_name("ravenclaw")], "ingress"))
    eg.append(rule("deny-to-slytherin-at-ports-80-53-9003", "Deny", [by_name("slytherin")], "egress", p3(80, 53, 9003)))
    ing.append(rule("deny-from-slytherin-at-port-80-53-9003", "Deny", [by_name("slytherin")], "ingress", p3(80, 53, 9003)))
    if admin:
        eg.append(rule("pass-to-slytherin-at-port-80-53-9003", "Pass", [by_name("slytherin")], "egress", p3(80, 53, 9003)))
        ing.append(rule("pass-from-slytherin-at-port-80-53-9003", "Pass", [by_name("slytherin")], "ingress", p3(80, 53, 9003)))
    # Upstream's baseline rule is named "...-8080-5353" but also holds SCTP 9003 (the
    # admin one says "-8080-5353-9003"): the content is followed.
    eg.append(rule("allow-to-hufflepuff-at-ports-8080-5353-9003" if admin else "allow-to-hufflepuff-at-ports-8080-5353",
                   "Accept", [by_name("hufflepuff")], "egress", p3(8080, 5353, 9003)))
    ing.append(rule("allow-from-hufflepuff-at-port-80-5353-9003", "Accept", [by_name("hufflepuff")], "ingress", p3(80, 5353, 9003)))
    eg.append(rule("deny-to-hufflepuff-everything-else", "Deny", [by_name("hufflepuff")], "egress"))
    ing.append(rule("deny-from-hufflepuff-everything-else", "Deny", [by_name("hufflepuff")], "ingress"))
    return cnp("gress-rules" if admin else "default", tier, 15 if admin else 10, by_name("gryffindor"), ingress=ing, egress=eg)


def inline_cidr(tier):
    admin = tier == "Admin"
    subject = pods_of("gryffindor") if admin else by_name("gryffindor")
    eg = [
        rule("allow-egress-to-slytherin", "Accept", [pods_of("slytherin")], "egress"),
        rule("deny-egress-to-internet", "Deny", [{"networks": ["0.0.0.0/0", "::/0"]}], "egress"),
    ]
    return cnp("inline-cidr-as-peers-example" if admin else "default", tier, 85 if admin else 10, subject, egress=eg)


def priority_field():
    return [
        cnp("priority-50-example", "Admin", 50, pods_of("gryffindor"),
            ingress=[rule("deny-all-ingress-from-slytherin", "Deny", [pods_of("slytherin")], "ingress")],
            egress=[rule("deny-all-egress-to-slytherin", "Deny", [pods_of("slytherin")], "egress")]),
        cnp("old-priority-60-new-priority-40-example", "Admin", 60, pods_of("gryffindor"),
            ingress=[rule("pass-all-ingress-from-slytherin", "Pass", [pods_of("slytherin")], "ingress")],
            egress=[rule("pass-all-egress-to-slytherin", "Pass", [pods_of("slytherin")], "egress")]),
        cnp("default", "Baseline", 10, pods_of("gryffindor"),
            ingress=[rule("allow-all-ingress-from-slytherin", "Accept", [pods_of("slytherin")], "ingress")],
            egress=[rule("allow-all-egress-to-slytherin", "Accept", [pods_of("slytherin")], "egress")]),
    ]


def integration():
    np = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"namespace": ns("gryffindor"), "name": "allow-gress-from-to-slytherin-to-gryffindor"},
        "spec": {
            "podSelector": {},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"conformance-house": "slytherin"}}}]}],
            "egress": [{"to": [{"namespaceSelector": {"matchLabels": {"conformance-house": "slytherin"}}}]}],
        },
    }
    admin = cnp("pass-example", "Admin", 10, by_house("gryffindor"),
                ingress=[rule("deny-all-ingress-from-slytherin", "Deny", [by_house("slytherin")], "ingress")],
                egress=[rule("deny-all-egress-to-slytherin", "Deny", [by_house("slytherin")], "egress")])
    baseline = cnp("default", "Baseline", 10, by_house("gryffindor"),
                   ingress=[rule("deny-all-ingress-from-slytherin", "Deny", [by_house("slytherin")], "ingress")],
                   egress=[rule("deny-all-egress-to-slytherin", "Deny", [by_house("slytherin")], "egress")])
    return admin, np, baseline


# --- case building ------------------------------------------------------------------


class Case:
    """One upstream test: the live objects, and one step per subtest."""

    def __init__(self, cid, short, gofile, manifest, objects):
        self.cid, self.short, self.gofile, self.manifest = cid, short, gofile, manifest
        self.objects = {}  # name -> live object (CNPs) ; NPs by ("np", ns, name)
        self.steps = []
        self.pending = []
        for o in objects:
            if o["kind"] == "ClusterNetworkPolicy":
                self.objects[o["metadata"]["name"]] = copy.deepcopy(o)
                self.pending.append({"create_cluster_network_policy": copy.deepcopy(o)})
            else:
                self.pending.append({"create_policy": copy.deepcopy(o)})

    def cnp(self, name):
        return self.objects[name]

    def mutate(self, name, fn):
        """Applies fn to the live object `name` and records the update."""
        fn(self.objects[name])
        self.pending.append({"update_cluster_network_policy": copy.deepcopy(self.objects[name])})

    def swap(self, name, direction, i, j):
        def f(o):
            r = o["spec"][direction]
            r[i], r[j] = r[j], r[i]
        self.mutate(name, f)

    def action(self, a):
        self.pending.append(a)

    def subtest(self, title, pokes):
        """pokes: (client, proto, server, port, expect) as in PokeServer."""
        groups = {}
        for client, p, server, port, expect in pokes:
            key = (p.upper(), port, server)
            groups.setdefault(key, {})
            assert pod(client) not in groups[key], (self.cid, client, key)
            groups[key][pod(client)] = "1" if expect else "0"
        probes = [
            {"port": port, "protocol": p, "pods": [pod(server)], "matrix": m}
            for (p, port, server), m in groups.items()
        ]
        step = {"upstream_subtest": title, "actions": self.pending, "probes": probes}
        self.pending = []
        self.steps.append(step)

    def render(self):
        return {
            "id": self.cid,
            "title": f"upstream: {self.short} ({SRC}/{self.gofile}, {self.manifest})",
            "steps": self.steps,
        }


def poke(client, p, server, port, expect):
    return (client, p, server, port, expect)


# The standard single-protocol tests. Admin subtests: allow everything (rule order),
# allow at port, deny (swap 0<->1), deny at port, pass (swap 0<->2), pass at port
# (swap 3<->4). Baseline: the first four. The probes of each (client, server, ports)
# are upstream's, per (direction, protocol).
SINGLE_POKES = {
    ("ingress", "tcp"): [
        [("luna-lovegood-0", "harry-potter-0", 80, True), ("luna-lovegood-1", "harry-potter-0", 8080, True)],
        [("cedric-diggory-0", "harry-potter-1", 80, True), ("cedric-diggory-1", "harry-potter-1", 8080, False)],
        [("luna-lovegood-0", "harry-potter-1", 80, False), ("luna-lovegood-1", "harry-potter-1", 8080, False)],
        [("draco-malfoy-0", "harry-potter-0", 80, False), ("draco-malfoy-1", "harry-potter-0", 8080, True)],
        [("luna-lovegood-0", "harry-potter-0", 80, True), ("luna-lovegood-1", "harry-potter-0", 8080, True)],
        [("draco-malfoy-0", "harry-potter-0", 80, True), ("draco-malfoy-1", "harry-potter-0", 8080, True)],
    ],
    ("ingress", "udp"): [
        [("luna-lovegood-0", "cedric-diggory-0", 53, True), ("luna-lovegood-1", "cedric-diggory-0", 5353, True)],
        [("harry-potter-0", "cedric-diggory-1", 53, True), ("harry-potter-1", "cedric-diggory-1", 5353, False)],
        [("luna-lovegood-0", "cedric-diggory-1", 53, False), ("luna-lovegood-1", "cedric-diggory-1", 5353, False)],
        [("draco-malfoy-0", "cedric-diggory-0", 5353, False), ("draco-malfoy-1", "cedric-diggory-0", 53, True)],
        [("luna-lovegood-0", "cedric-diggory-1", 5353, True), ("luna-lovegood-1", "cedric-diggory-1", 53, True)],
        [("draco-malfoy-0", "cedric-diggory-0", 5353, True), ("draco-malfoy-1", "cedric-diggory-0", 53, True)],
    ],
    ("ingress", "sctp"): [
        [("harry-potter-0", "luna-lovegood-0", 9003, True), ("harry-potter-1", "luna-lovegood-0", 9005, True)],
        [("cedric-diggory-0", "luna-lovegood-1", 9003, True), ("cedric-diggory-1", "luna-lovegood-1", 9005, False)],
        [("harry-potter-0", "luna-lovegood-1", 9003, False), ("harry-potter-1", "luna-lovegood-1", 9005, False)],
        [("draco-malfoy-0", "luna-lovegood-0", 9003, False), ("draco-malfoy-1", "luna-lovegood-0", 9005, True)],
        [("harry-potter-0", "luna-lovegood-1", 9003, True), ("harry-potter-1", "luna-lovegood-1", 9005, True)],
        [("draco-malfoy-0", "luna-lovegood-0", 9003, True), ("draco-malfoy-1", "luna-lovegood-0", 9005, True)],
    ],
    ("egress", "tcp"): [
        [("harry-potter-0", "luna-lovegood-0", 80, True), ("harry-potter-1", "luna-lovegood-0", 8080, True)],
        [("harry-potter-0", "cedric-diggory-1", 8080, True), ("harry-potter-1", "cedric-diggory-1", 80, False)],
        [("harry-potter-0", "luna-lovegood-1", 80, False), ("harry-potter-1", "luna-lovegood-1", 8080, False)],
        [("harry-potter-0", "draco-malfoy-0", 80, False), ("harry-potter-1", "draco-malfoy-0", 8080, True)],
        [("harry-potter-0", "luna-lovegood-0", 80, True), ("harry-potter-1", "luna-lovegood-0", 8080, True)],
        [("harry-potter-0", "draco-malfoy-0", 80, True), ("harry-potter-1", "draco-malfoy-0", 8080, True)],
    ],
    ("egress", "udp"): [
        [("cedric-diggory-0", "luna-lovegood-0", 53, True), ("cedric-diggory-1", "luna-lovegood-0", 5353, True)],
        [("cedric-diggory-0", "harry-potter-1", 53, True), ("cedric-diggory-1", "harry-potter-1", 5353, False)],
        [("cedric-diggory-0", "luna-lovegood-1", 53, False), ("cedric-diggory-1", "luna-lovegood-1", 5353, False)],
        [("cedric-diggory-0", "draco-malfoy-0", 5353, False), ("cedric-diggory-1", "draco-malfoy-0", 53, True)],
        [("cedric-diggory-0", "luna-lovegood-1", 5353, True), ("cedric-diggory-1", "luna-lovegood-1", 53, True)],
        [("cedric-diggory-0", "draco-malfoy-0", 5353, True), ("cedric-diggory-1", "draco-malfoy-0", 53, True)],
    ],
    ("egress", "sctp"): [
        [("luna-lovegood-0", "harry-potter-0", 9003, True), ("luna-lovegood-1", "harry-potter-0", 9005, True)],
        [("luna-lovegood-0", "cedric-diggory-1", 9003, True), ("luna-lovegood-1", "cedric-diggory-1", 9005, False)],
        [("luna-lovegood-0", "harry-potter-1", 9003, False), ("luna-lovegood-1", "harry-potter-1", 9005, False)],
        [("luna-lovegood-0", "draco-malfoy-0", 9003, False), ("luna-lovegood-1", "draco-malfoy-0", 9005, True)],
        [("luna-lovegood-0", "harry-potter-1", 9003, True), ("luna-lovegood-1", "harry-potter-1", 9005, True)],
        [("luna-lovegood-0", "draco-malfoy-0", 9003, True), ("luna-lovegood-1", "draco-malfoy-0", 9005, True)],
    ],
}

SINGLE_TITLES = [
    "Should support an 'allow-{d}' policy for {P} protocol; ensure rule ordering is respected",
    "Should support an 'allow-{d}' policy for {P} protocol at the specified port",
    "Should support an 'deny-{d}' policy for {P} protocol; ensure rule ordering is respected",
    "Should support a 'deny-{d}' policy for {P} protocol at the specified port",
    "Should support an 'pass-{d}' policy for {P} protocol; ensure rule ordering is respected",
    "Should support a 'pass-{d}' policy for {P} protocol at the specified port",
]


def single_case(tier, direction, p):
    obj = single(tier, direction, p)
    name = obj["metadata"]["name"]
    t = "admin" if tier == "Admin" else "baseline"
    prefix = "admin-network-policy" if tier == "Admin" else "baseline-admin-network-policy"
    short = f"CNP{tier}Tier{direction.capitalize()}{p.upper()}"
    c = Case(f"cnp-{t}-{direction}-{p}", short, f"{prefix}-standard-{direction}-{p}-rules.go",
             f"base/{t}_tier/standard-{direction}-{p}-rules.yaml", [obj])
    n = 6 if tier == "Admin" else 4
    for i in range(n):
        if i == 2:
            c.swap(name, direction, 0, 1)
        elif i == 4:
            c.swap(name, direction, 0, 2)
        elif i == 5:
            c.swap(name, direction, 3, 4)
        title = SINGLE_TITLES[i].format(d=direction, P=p.upper())
        c.subtest(title, [poke(cl, p, srv, port, e) for cl, srv, port, e in SINGLE_POKES[(direction, p)][i]])
    return c.render()


def gress_case(tier):
    admin = tier == "Admin"
    t = "admin" if admin else "baseline"
    prefix = "admin-network-policy" if admin else "baseline-admin-network-policy"
    obj = gress(tier)
    name = obj["metadata"]["name"]
    c = Case(f"cnp-{t}-gress", f"CNP{tier}TierGress", f"{prefix}-standard-gress-rules.go",
             f"base/{t}_tier/standard-gress-rules-combined.yaml", [obj])
    H0, H1 = "harry-potter-0", "harry-potter-1"
    c.subtest("Should support an 'allow-gress' policy across different protocols", [
        poke(H0, "tcp", "luna-lovegood-0", 80, True), poke(H1, "udp", "luna-lovegood-0", 53, True),
        poke(H0, "sctp", "luna-lovegood-0", 9003, True),
        poke("luna-lovegood-0", "tcp", H0, 80, True), poke("luna-lovegood-1", "udp", H0, 53, True),
        poke("luna-lovegood-1", "sctp", H0, 9003, True)])
    c.subtest("Should support an 'allow-gress' policy across different protocols at the specified ports", [
        poke(H0, "tcp", "cedric-diggory-1", 8080, True), poke(H1, "tcp", "cedric-diggory-1", 80, False),
        poke(H0, "udp", "cedric-diggory-1", 5353, True), poke(H1, "udp", "cedric-diggory-1", 53, False),
        poke(H0, "sctp", "cedric-diggory-1", 9003, True), poke(H1, "sctp", "cedric-diggory-1", 9005, False),
        poke("cedric-diggory-0", "tcp", H1, 80, True), poke("cedric-diggory-1", "tcp", H1, 8080, False),
        poke("cedric-diggory-0", "udp", H1, 5353, True), poke("cedric-diggory-1", "udp", H1, 53, False),
        poke("cedric-diggory-0", "sctp", H1, 9003, True), poke("cedric-diggory-1", "sctp", H1, 9005, False)])
    c.swap_both = None

    def swap_both(i, j):
        def f(o):
            for d in ("egress", "ingress"):
                r = o["spec"][d]
                r[i], r[j] = r[j], r[i]
        c.mutate(name, f)

    swap_both(0, 1)
    c.subtest("Should support an 'deny-gress' policy across different protocols", [
        poke(H0, "tcp", "luna-lovegood-1", 80, False), poke(H1, "udp", "luna-lovegood-1", 53, False),
        poke(H0, "sctp", "luna-lovegood-1", 9003, False),
        poke("luna-lovegood-0", "tcp", H1, 80, False), poke("luna-lovegood-1", "udp", H1, 53, False),
        poke("luna-lovegood-1", "sctp", H1, 9003, False)])
    c.subtest("Should support a 'deny-gress' policy across different protocols at the specified ports", [
        poke(H0, "tcp", "draco-malfoy-0", 80, False), poke(H1, "tcp", "draco-malfoy-0", 8080, True),
        poke(H0, "udp", "draco-malfoy-0", 53, False), poke(H1, "udp", "draco-malfoy-0", 5353, True),
        poke(H0, "sctp", "draco-malfoy-0", 9003, False), poke(H1, "sctp", "draco-malfoy-0", 9005, True),
        poke("draco-malfoy-0", "tcp", H0, 80, False), poke("draco-malfoy-1", "tcp", H0, 8080, True),
        poke("draco-malfoy-0", "udp", H0, 53, False), poke("draco-malfoy-1", "udp", H0, 5353, True),
        poke("draco-malfoy-0", "sctp", H0, 9003, False), poke("draco-malfoy-1", "sctp", H0, 9005, True)])
    if admin:
        swap_both(0, 2)
        c.subtest("Should support an 'pass-gress' policy across different protocols", [
            poke(H0, "tcp", "luna-lovegood-0", 80, True), poke(H0, "udp", "luna-lovegood-0", 5353, True),
            poke(H0, "sctp", "luna-lovegood-0", 9003, True),
            poke("luna-lovegood-0", "tcp", H0, 80, True), poke("luna-lovegood-1", "udp", H0, 53, True),
            poke("luna-lovegood-1", "sctp", H0, 9003, True)])
        swap_both(3, 4)
        c.subtest("Should support a 'pass-gress' policy across different protocols at the specified ports", [
            poke(H0, "tcp", "draco-malfoy-0", 80, True), poke(H1, "tcp", "draco-malfoy-0", 8080, True),
            poke(H0, "udp", "draco-malfoy-0", 53, True), poke(H1, "udp", "draco-malfoy-0", 5353, True),
            poke(H0, "sctp", "draco-malfoy-0", 9003, True), poke(H1, "sctp", "draco-malfoy-0", 9005, True),
            poke("draco-malfoy-0", "tcp", H0, 80, True), poke("draco-malfoy-1", "tcp", H0, 8080, True),
            poke("draco-malfoy-0", "udp", H0, 53, True), poke("draco-malfoy-1", "udp", H0, 5353, True),
            poke("draco-malfoy-0", "sctp", H0, 9003, True), poke("draco-malfoy-1", "sctp", H0, 9005, True)])
    return c.render()


def cidr_case(tier):
    admin = tier == "Admin"
    t = "admin" if admin else "baseline"
    prefix = "admin-network-policy" if admin else "baseline-admin-network-policy"
    obj = inline_cidr(tier)
    name = obj["metadata"]["name"]
    c = Case(f"cnp-{t}-egress-inline-cidr", f"CNP{tier}TierEgressInlineCIDRPeers",
             f"{prefix}-standard-egress-inline-cidr-rules.go",
             f"base/{t}_tier/standard-egress-inline-cidr-rules.yaml", [obj])
    H1 = "harry-potter-1"

    def three(server, expect):
        return [poke(H1, "tcp", server, 80, expect), poke(H1, "udp", server, 53, expect),
                poke(H1, "sctp", server, 9003, expect)]

    sub = "Should support a 'deny-egress' rule policy for egress-cidr-peer"
    # Upstream's first subtest relabels slytherin twice with probes in between: three
    # steps here, all under its title.
    c.subtest(sub, three("luna-lovegood-0", False) + three("cedric-diggory-0", False) + three("draco-malfoy-0", True))
    c.action({"set_namespace_labels": {"namespace": ns("slytherin"), "labels": {"conformance-house": "denied-namespace-label"}}})
    c.subtest(sub + " (slytherin relabelled conformance-house=denied-namespace-label)", three("draco-malfoy-0", False))
    c.action({"set_namespace_labels": {"namespace": ns("slytherin"), "labels": {"conformance-house": "slytherin"}}})
    c.subtest(sub + " (slytherin label restored)", three("draco-malfoy-0", True))

    def insert(o):
        o["spec"]["egress"].insert(0, {
            "name": "allow-egress-to-specific-podIPs",
            "action": "Accept",
            "to": [{"networks": ["${CIDR32:%s}" % pod("luna-lovegood-0"), "${CIDR32:%s}" % pod("cedric-diggory-0")]}],
        })
    c.mutate(name, insert)
    c.subtest("Should support an 'allow-egress' rule policy for egress-cidr-peer",
              three("luna-lovegood-0", True) + three("cedric-diggory-0", True)
              + three("luna-lovegood-1", False) + three("cedric-diggory-1", False))
    return c.render()


def priority_case():
    objs = priority_field()
    c = Case("cnp-admin-priority-field", "CNPAdminTierPriorityField", "admin-network-policy-standard-priority.go",
             "base/admin_tier/standard-priority-field.yaml", objs)
    c.subtest("Should Deny traffic from slytherin to gryffindor respecting admin CNP", [
        poke("draco-malfoy-0", "tcp", "harry-potter-0", 80, False),
        poke("draco-malfoy-1", "tcp", "harry-potter-0", 8080, False)])
    c.subtest("Should Deny traffic to slytherin from gryffindor respecting admin CNP", [
        poke("harry-potter-0", "tcp", "draco-malfoy-0", 80, False),
        poke("harry-potter-1", "tcp", "draco-malfoy-0", 8080, False)])
    c.mutate("old-priority-60-new-priority-40-example", lambda o: o["spec"].__setitem__("priority", 40))
    c.subtest("Should respect admin CNP priority field; thus passing both ingress and egress traffic over to baseline CNP", [
        poke("draco-malfoy-0", "tcp", "harry-potter-0", 80, True),
        poke("draco-malfoy-1", "tcp", "harry-potter-0", 8080, True),
        poke("harry-potter-0", "tcp", "draco-malfoy-0", 80, True),
        poke("harry-potter-1", "tcp", "draco-malfoy-0", 8080, True)])
    return c.render()


def integration_case():
    admin, np, baseline = integration()
    c = Case("cnp-admin-integration", "CNPAdminTierIntegration", "admin-network-policy-standard-integration.go",
             "base/api_integration/standard-anp-np-banp.yaml", [admin, np, baseline])
    H0, D0 = "harry-potter-0", "draco-malfoy-0"
    c.subtest("Should Deny traffic from slytherin to gryffindor respecting admin CNP", [
        poke("draco-malfoy-0", "tcp", H0, 80, False), poke("draco-malfoy-1", "tcp", H0, 8080, False)])
    c.subtest("Should Deny traffic to slytherin from gryffindor respecting admin CNP", [
        poke("harry-potter-0", "tcp", D0, 80, False), poke("harry-potter-1", "tcp", D0, 8080, False)])
    c.mutate("pass-example", lambda o: o["spec"]["ingress"][0].__setitem__("action", "Pass"))
    c.subtest("Should support a 'pass-ingress' policy for admin CNP and respect the match for network policy", [
        poke("draco-malfoy-0", "tcp", H0, 80, True), poke("draco-malfoy-1", "tcp", H0, 8080, True)])
    c.mutate("pass-example", lambda o: o["spec"]["egress"][0].__setitem__("action", "Pass"))
    c.subtest("Should support a 'pass-egress' policy for admin CNP and respect the match for network policy", [
        poke("harry-potter-0", "tcp", D0, 80, True), poke("harry-potter-1", "tcp", D0, 8080, True)])
    c.action({"delete_policy": {"namespace": ns("gryffindor"), "name": np["metadata"]["name"]}})
    c.subtest("Should support a 'pass-ingress' policy for admin CNP and respect the match for baseline cluster network policy", [
        poke("draco-malfoy-0", "tcp", H0, 80, False), poke("draco-malfoy-1", "tcp", H0, 8080, False)])
    c.subtest("Should support a 'pass-egress' policy for admin CNP and respect the match for baseline cluster network policy", [
        poke("harry-potter-0", "tcp", D0, 80, False), poke("harry-potter-1", "tcp", D0, 8080, False)])
    return c.render()


def named_port_cases():
    """The experimental named-port tests (destinationNamedPort)."""
    out = []

    def named(o, direction, index, port_name):
        o["spec"][direction][index]["protocols"] = [{"destinationNamedPort": port_name}]

    # CNPAdminTierEgressNamedPort: egress-tcp, rule 5 (accept hufflepuff at 8080) -> "web".
    obj = single("Admin", "egress", "tcp")
    c = Case("cnp-admin-egress-named-port", "CNPAdminTierEgressNamedPort",
             "admin-network-policy-experimental-egress-rules.go", "base/admin_tier/standard-egress-tcp-rules.yaml", [obj])
    c.mutate("egress-tcp", lambda o: named(o, "egress", 5, "web"))
    c.subtest("Should support an 'allow-egress' policy for named port", [
        poke("harry-potter-0", "tcp", "cedric-diggory-1", 80, True),
        poke("harry-potter-1", "tcp", "cedric-diggory-1", 8080, False)])
    out.append(c.render())
    # CNPAdminTierIngressNamedPort: ingress-udp, rule 5 (accept gryffindor at 53) -> "dns".
    obj = single("Admin", "ingress", "udp")
    c = Case("cnp-admin-ingress-named-port", "CNPAdminTierIngressNamedPort",
             "admin-network-policy-experimental-ingress-rules.go", "base/admin_tier/standard-ingress-udp-rules.yaml", [obj])
    c.mutate("ingress-udp", lambda o: named(o, "ingress", 5, "dns"))
    c.subtest("Should support an 'allow-ingress' policy for named port", [
        poke("harry-potter-0", "udp", "cedric-diggory-1", 53, True),
        poke("harry-potter-1", "udp", "cedric-diggory-1", 5353, False)])
    out.append(c.render())
    # CNPBaselineTierEgressNamedPort: baseline egress-udp, rule 3 (accept gryffindor at 53) -> "dns".
    obj = single("Baseline", "egress", "udp")
    c = Case("cnp-baseline-egress-named-port", "CNPBaselineTierEgressNamedPort",
             "baseline-admin-network-policy-experimental-egress-rules.go",
             "base/baseline_tier/standard-egress-udp-rules.yaml", [obj])
    c.mutate("default", lambda o: named(o, "egress", 3, "dns"))
    c.subtest("Should support an 'allow-egress' policy for named port", [
        poke("cedric-diggory-0", "udp", "harry-potter-1", 53, True),
        poke("cedric-diggory-1", "udp", "harry-potter-1", 5353, False)])
    out.append(c.render())
    # CNPBaselineTierIngressNamedPort: baseline ingress-tcp, rule 3 (accept hufflepuff at 80) -> "web".
    obj = single("Baseline", "ingress", "tcp")
    c = Case("cnp-baseline-ingress-named-port", "CNPBaselineTierIngressNamedPort",
             "baseline-admin-network-policy-experimental-ingress-rules.go",
             "base/baseline_tier/standard-ingress-tcp-rules.yaml", [obj])
    c.mutate("default", lambda o: named(o, "ingress", 3, "web"))
    c.subtest("Should support an 'allow-ingress' policy for named port", [
        poke("cedric-diggory-0", "tcp", "harry-potter-1", 80, True),
        poke("cedric-diggory-1", "tcp", "harry-potter-1", 8080, False)])
    out.append(c.render())
    return out


def nodes_peer(sel=None):
    return {"nodes": {"matchLabels": sel or {"kubernetes.io/os": "linux"}}}


def node_peer_cnp(tier):
    """base/{admin,baseline}_tier/experimental-egress-selector-rules.yaml."""
    if tier == "Admin":
        eg = [
            rule(f"allow-egress-to-{HNP[0]}-on-nodes", "Accept", [nodes_peer()], "egress", [proto("tcp", HNP[0])]),
            rule(f"pass-egress-to-{HNP[2]}-on-nodes", "Pass", [nodes_peer()], "egress", [proto("udp", HNP[2])]),
            rule("deny-egress-to-slytherin-and-nodes-and-internet", "Deny",
                 [pods_of("slytherin"), nodes_peer(), {"networks": ["0.0.0.0/0", "::/0"]}], "egress"),
        ]
        return cnp("node-and-cidr-as-peers-example", "Admin", 75, pods_of("gryffindor"), egress=eg)
    eg = [
        rule(f"allow-egress-to-{HNP[0]}-on-nodes", "Accept", [nodes_peer()], "egress",
             [{"tcp": {"destinationPort": {"range": {"start": HNP[0], "end": HNP[1]}}}}]),
        rule("deny-egress-to-nodes-and-internet", "Deny", [nodes_peer(), {"networks": ["0.0.0.0/0", "::/0"]}], "egress"),
    ]
    return cnp("default", "Baseline", 10, by_name("gryffindor"), egress=eg)


def node_peer_cases():
    """The experimental node-peer tests (CNP{Admin,Baseline}TierEgressNodePeers): egress
    from gryffindor to the host-network pod centaur-1 (its address is its node's)."""
    out = []
    C1 = "centaur-1"
    subtests = {
        "Admin": [
            ("Should support an 'allow-egress' rule policy for egress-node-peer",
             [poke("harry-potter-1", "tcp", C1, HNP[0], True)]),
            ("Should support a 'pass-egress' rule policy for egress-node-peer",
             [poke("harry-potter-1", "udp", C1, HNP[2], True)]),
            ("Should support a 'deny-egress' rule policy for egress-node-peer",
             [poke("harry-potter-1", "tcp", C1, HNP[1], False), poke("harry-potter-1", "udp", C1, HNP[4], False),
              poke("harry-potter-1", "sctp", C1, HNP[6], False)]),
        ],
        "Baseline": [
            ("Should support an 'allow-egress' rule policy for egress-node-peer",
             [poke("harry-potter-0", "tcp", C1, HNP[0], True), poke("harry-potter-1", "tcp", C1, HNP[1], True)]),
            ("Should support a 'deny-egress' rule policy for egress-node-peer",
             [poke("harry-potter-1", "udp", C1, HNP[4], False), poke("harry-potter-1", "sctp", C1, HNP[6], False)]),
        ],
    }
    for tier in ("Admin", "Baseline"):
        t = "admin" if tier == "Admin" else "baseline"
        prefix = "admin-network-policy" if tier == "Admin" else "baseline-admin-network-policy"
        c = Case(f"cnp-{t}-egress-node-peers", f"CNP{tier}TierEgressNodePeers",
                 f"{prefix}-experimental-egress-rules.go", f"base/{t}_tier/experimental-egress-selector-rules.yaml",
                 [node_peer_cnp(tier)])
        every = [pk for _, pokes in subtests[tier] for pk in pokes]
        # Not upstream: before the policy exists every probed port answers, on both
        # host-network pods (so a 0 below is the policy, not a missing server).
        create, c.pending = c.pending, []
        seen = []
        # SCTP included: the pods' raw receivers answer an INIT from the address it was
        # sent to (a host-network pod's node has several), as an SCTP endpoint does.
        for cl, p, _, port, _ in every:
            for srv in ("centaur-1", "centaur-0"):
                if (cl, p, srv, port) not in seen:
                    seen.append((cl, p, srv, port))
        c.subtest("(not upstream) before the policy: every probed port of both host-network pods answers",
                  [(cl, p, srv, port, True) for cl, p, srv, port in seen])
        c.pending = create
        for title, pokes in subtests[tier]:
            c.subtest(title, pokes)
        # Not upstream: the same pokes against centaur-0, the other host-network pod
        # (the client's own node: this node's address in the simulator and in
        # multi-node runs, where centaur-1 is another node's).
        c.subtest("(not upstream) the same expectations against centaur-0, the host-network pod on the client's node",
                  [(cl, p, "centaur-0", port, e) for cl, p, _, port, e in every])
        out.append(c.render())
    return out


def xyz_cases():
    """ClusterNetworkPolicy actions on the x/y/z model, with full 9x9 matrices
    (not upstream: the tier order of the API's documentation on the netpol model)."""
    pods = [f"{n}/{p}" for n in "xyz" for p in "abc"]

    def matrix(allowed):
        return {src: "".join("1" if allowed(src.split("/")[0], dst.split("/")[0]) else "0" for dst in pods)
                for src in pods}

    def probe(port, allowed, p="TCP"):
        return {"port": port, "protocol": p, "matrix": matrix(allowed)}

    def nsel(n):
        return {"namespaces": {"matchLabels": {"ns": n}}}

    admin = cnp("x-from-y", "Admin", 20, nsel("x"),
                ingress=[rule("deny-y-80", "Deny", [nsel("y")], "ingress", [proto("tcp", 80)])])
    passed = copy.deepcopy(admin)
    passed["spec"]["ingress"][0]["action"] = "Pass"
    np = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"namespace": "x", "name": "from-z"},
        "spec": {"podSelector": {}, "policyTypes": ["Ingress"],
                 "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"ns": "z"}}}]}]},
    }
    baseline = cnp("x-baseline", "Baseline", 5, nsel("x"),
                   ingress=[rule("deny-z", "Deny", [nsel("z")], "ingress")])
    steps = [
        {"note": "Admin Deny y -> x on TCP 80 only",
         "actions": [{"create_cluster_network_policy": admin}],
         "probes": [probe(80, lambda s, d: not (s == "y" and d == "x")), probe(81, lambda s, d: True)]},
        {"note": "the rule becomes Pass; a NetworkPolicy isolates x and admits z: it decides y -> x",
         "actions": [{"update_cluster_network_policy": passed}, {"create_policy": np}],
         "probes": [probe(80, lambda s, d: d != "x" or s == "z"), probe(81, lambda s, d: d != "x" or s == "z")]},
        {"note": "NetworkPolicy deleted, Baseline denies z -> x: y passes the Admin tier and nothing else matches",
         "actions": [{"delete_policy": {"namespace": "x", "name": "from-z"}},
                     {"create_cluster_network_policy": baseline}],
         "probes": [probe(80, lambda s, d: not (s == "z" and d == "x")),
                    probe(81, lambda s, d: not (s == "z" and d == "x"), "UDP")]},
        {"note": "both deleted: everything connects",
         "actions": [{"delete_cluster_network_policy": {"name": "x-baseline"}},
                     {"delete_cluster_network_policy": {"name": "x-from-y"}}],
         "probes": [probe(80, lambda s, d: True)]},
    ]
    return [{"id": "cnp-xyz-tiers", "title": "ClusterNetworkPolicy tiers on the x/y/z model: Admin Deny, Pass to a "
             "NetworkPolicy, Baseline Deny, deletion", "topology": "xyz", "steps": steps}]


NOTES = """\
Upstream code vs. comments (the cases follow the code: the applied objects and the asserted expectations):
- the baseline gress rule `allow-to-hufflepuff-at-ports-8080-5353` also holds SCTP 9003 (kept);
- CNPAdminTierIngressTCP's last subtest says "PASSED ... at port 9003" but probes TCP 80 (80 kept);
- the baseline node-peer test comments "Pass rule at index2" on an allowed TCP probe (Baseline has
  no Pass; rule 0, the Accept of the TCP range, decides it) and its deny subtest says "egressRule at
  index1" (kept: rule 1 denies); the admin one says "egressRule at index1/index2" for pass and deny
  (rules 1 and 2, kept).
- node peers: the host-network pods centaur-0/1 have their node's address; the probes target
  centaur-1 as upstream, plus two steps marked "not upstream": before the policy, every probed
  TCP/UDP/SCTP port of both pods answers; after the subtests, the same
  expectations against centaur-0.
"""


def files():
    admin = [single_case("Admin", d, p) for d in ("ingress", "egress") for p in ("tcp", "udp", "sctp")]
    baseline = [single_case("Baseline", d, p) for d in ("ingress", "egress") for p in ("tcp", "udp", "sctp")]
    return {
        "cnp-admin.yaml": admin + [gress_case("Admin"), cidr_case("Admin")],
        "cnp-baseline.yaml": baseline + [gress_case("Baseline"), cidr_case("Baseline")],
        "cnp-integration.yaml": [priority_case(), integration_case()],
        "cnp-named-ports.yaml": named_port_cases(),
        "cnp-nodes.yaml": node_peer_cases(),
        "cnp-xyz.yaml": xyz_cases(),
    }


def main():
    try:
        import yaml
    except ImportError:
        print("needs PyYAML (pip install pyyaml)", file=sys.stderr)
        return 1
    for fname, cases in files().items():
        xyz = fname == "cnp-xyz.yaml"
        with open(os.path.join(OUT, fname), "w") as f:
            f.write("# Generated by tests/conformance/gen/cnp.py: edit the generator, not this file.\n")
            if xyz:
                f.write("# ClusterNetworkPolicy actions on the x/y/z model (not upstream), full matrices:\n")
                f.write("# rows = source pod, columns = x/a..z/c, 1 = connects.\n")
            else:
                f.write("# The ClusterNetworkPolicy conformance tests of %s, one case per test and one\n" % SRC)
                f.write("# step per subtest (upstream subtests share state). A probe row = one upstream PokeServer:\n")
                f.write("# client -> the probe's single `pods` entry, 1 = connects, 0 = times out.\n")
                for line in NOTES.splitlines():
                    f.write("# " + line + "\n")
            for c in cases:
                c.pop("topology", None)
            doc = {"topology": "xyz" if xyz else "network-policy-api", "cases": cases}
            yaml.safe_dump(doc, f, sort_keys=False, width=200, default_flow_style=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
