"""Only the operator makes a pod an AFD instance's member (membership.py), and the chart values
that bound the instances' traffic are read strictly. The API server in the loop:
tests/test_webhook.py and the real node's tests/realnode/test_afd_e2e.py."""

from __future__ import annotations

import pytest

from afd_operator import naming
from afd_operator.membership import GUARDED_LABELS, membership_refusal
from afd_operator.policy import DEFAULT_DNS_TO, PolicyError, policy_from_values
from afd_operator.run import build_parser, config_from_args

OPERATOR = "system:serviceaccount:afd-system:afd-operator"
TENANT = "system:serviceaccount:team-a:default"
MEMBER = {naming.LABEL_DEPLOYMENT: "ds", naming.LABEL_AFD_INSTANCE: "ds-r-0", naming.LABEL_ROLE: "ffn",
          naming.LABEL_MANAGED_BY: naming.MANAGER}


def test_every_selector_label_of_the_operators_objects_is_guarded() -> None:
    """The webhook sees a pod only through GUARDED_LABELS: each selector the operator writes must
    need one of them, or a pod could match it unseen."""
    from test_planner import spec_of

    from afd_operator.planner import plan
    from afd_operator.render import render

    spec = spec_of(platform="cpu", metrics={"podMonitor": True})
    selectors = []
    for obj in render(spec, plan(spec, "ds", "ns")):
        if obj["kind"] == "Service":
            selectors.append(obj["spec"]["selector"])
        elif obj["kind"] in ("PodDisruptionBudget", "PodMonitor"):
            selectors.append(obj["spec"]["selector"]["matchLabels"])
        elif obj["kind"] == "NetworkPolicy":
            selectors.append(obj["spec"]["podSelector"]["matchLabels"])
    assert {"Service", "PodDisruptionBudget", "PodMonitor", "NetworkPolicy"} <= {
        o["kind"] for o in render(spec, plan(spec, "ds", "ns"))}
    assert selectors and all(set(selector) & set(GUARDED_LABELS) for selector in selectors), selectors


def test_the_operator_may_create_and_relabel_its_pods() -> None:
    assert membership_refusal("CREATE", OPERATOR, OPERATOR, None, MEMBER) is None
    serving = {**MEMBER, naming.LABEL_SERVING: "true"}
    assert membership_refusal("UPDATE", OPERATOR, OPERATOR, MEMBER, serving) is None


def test_nobody_else_creates_a_member_or_changes_membership_labels() -> None:
    refusal = membership_refusal("CREATE", TENANT, OPERATOR, None, {naming.LABEL_AFD_INSTANCE: "ds-r-0", "app": "x"})
    assert refusal == (f"labels {naming.LABEL_AFD_INSTANCE} are set by the afd-operator alone (they make a pod a "
                       f"member of an AFD instance); {TENANT} may not create such a pod")
    for changed in ({**MEMBER, naming.LABEL_SERVING: "true"},            # added: the API Service selects it
                    {**MEMBER, naming.LABEL_AFD_INSTANCE: "other-r-0"},  # moved to another instance
                    {k: v for k, v in MEMBER.items() if k != naming.LABEL_ROLE}):  # removed
        refusal = membership_refusal("UPDATE", TENANT, OPERATOR, MEMBER, changed)
        assert refusal is not None and refusal.endswith(f"{TENANT} may not change them"), refusal
    refusal = membership_refusal("UPDATE", TENANT, OPERATOR, {"app": "x"}, {"app": "x", **MEMBER})
    assert refusal is not None and naming.LABEL_DEPLOYMENT in refusal and naming.LABEL_AFD_INSTANCE in refusal


def test_other_pods_and_other_edits_pass() -> None:
    assert membership_refusal("CREATE", TENANT, OPERATOR, None, {"app": "x"}) is None
    assert membership_refusal("CREATE", TENANT, OPERATOR, None, None) is None
    # The garbage collector's finalizer removal, a user's own label: afd labels unchanged.
    assert membership_refusal("UPDATE", TENANT, OPERATOR, MEMBER, {**MEMBER, "team": "search"}) is None
    assert membership_refusal("UPDATE", TENANT, OPERATOR, MEMBER, dict(MEMBER)) is None


def test_the_webhook_needs_the_operators_user_name() -> None:
    base = ["--webhook-port", "9443", "--webhook-host", "h", "--webhook-cert", "c", "--webhook-key", "k"]
    with pytest.raises(SystemExit, match="--webhook-port needs --operator-username"):
        config_from_args(build_parser().parse_args(base))
    config = config_from_args(build_parser().parse_args([*base, "--operator-username", OPERATOR]))
    assert config.webhook is not None and config.webhook.operator_username == OPERATOR


def test_egress_values_are_read_strictly() -> None:
    network = policy_from_values({}).network
    assert network.dns_to == DEFAULT_DNS_TO and network.egress_to == ()
    grant = {"to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}], "ports": [{"port": 9000}]}
    network = policy_from_values({"networkPolicy": {"egressTo": [grant]}}).network
    assert network.egress_to == ({"to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}],
                                  "ports": [{"port": 9000}]},)
    for bad, where in (({"to": [], "ports": [{"port": 1}]}, "networkPolicy.egressTo.0.to"),
                       ({"to": [{"ipBlock": {"cidr": "10.0.0.0/8"}}]}, "networkPolicy.egressTo.0.ports"),
                       ({"to": [{"podSelector": {}}], "ports": [{"port": 70000}]},
                        "networkPolicy.egressTo.0.ports.0.port"),
                       ({"to": [{"podSelector": {}}], "ports": [{"port": 53, "protocol": "ICMP"}]},
                        "networkPolicy.egressTo.0.ports.0.protocol")):
        with pytest.raises(PolicyError, match=f"^{where}: "):
            policy_from_values({"networkPolicy": {"egressTo": [bad]}})
    with pytest.raises(PolicyError, match="^networkPolicy.dnsTo.0: "):
        policy_from_values({"networkPolicy": {"dnsTo": [{}]}})
