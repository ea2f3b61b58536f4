"""The chart's admission webhooks as `helm template` renders them: one per kopf handler path,
the certificate they are served with, and a render that is the same every time when the
certificate is the admin's (GitOps renderers never reach the cluster)."""

from __future__ import annotations

import base64
import json
import subprocess
from pathlib import Path

from k8s_helpers import Helm
from test_chart import CHART, RELEASE, RELEASE_NS, find, helm4, render  # noqa: F401 (helm4: a fixture)


def test_webhook_certificate_serves_the_service_name(helm4: Helm, repo_root: Path, tmp_path: Path) -> None:
    objects = render(helm4, repo_root)
    (secret,) = find(objects, "Secret")
    (config,) = find(objects, "ValidatingWebhookConfiguration")
    # kopf serves each handler at /<its id> (main.register); the pod webhooks see only pods with
    # one of the guarded labels.
    hooks = {w["name"]: w for w in config["webhooks"]}
    assert {name: (w["clientConfig"]["service"]["path"], w["rules"][0]["resources"], w.get("objectSelector"))
            for name, w in hooks.items()} == {
        "validation.afd.inference.dev": ("/afddeployment-validation", ["afddeployments"], None),
        "scale-validation.afd.inference.dev": ("/afddeployment-scale-validation", ["afddeployments/scale"], None),
        **{f"pod-membership-{label}.afd.inference.dev": (
            f"/pod-membership-{label}", ["pods"],
            {"matchExpressions": [{"key": f"afd.inference.dev/{label}", "operator": "Exists"}]})
           for label in ("deployment", "instance")}}
    for webhook in hooks.values():
        assert webhook["clientConfig"]["service"]["name"] == f"{RELEASE}-webhook"
        assert webhook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
        assert webhook["rules"][0]["operations"] == (["UPDATE"] if "scale" in webhook["name"] else
                                                     ["CREATE", "UPDATE"]) and webhook["failurePolicy"] == "Fail"
    (deployment,) = find(objects, "Deployment")
    assert (f"--operator-username=system:serviceaccount:{RELEASE_NS}:{RELEASE}"
            in deployment["spec"]["template"]["spec"]["containers"][0]["args"])
    ca, cert = tmp_path / "ca.crt", tmp_path / "tls.crt"
    ca.write_bytes(base64.b64decode(secret["data"]["ca.crt"]))
    cert.write_bytes(base64.b64decode(secret["data"]["tls.crt"]))
    # What the apiserver checks: the serving certificate chains to caBundle, for the Service's name.
    verify = subprocess.run(["openssl", "verify", "-CAfile", str(ca), "-purpose", "sslserver",
                             "-verify_hostname", f"{RELEASE}-webhook.{RELEASE_NS}.svc", str(cert)],
                            capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_an_existing_secret_makes_every_render_the_same(helm4: Helm, repo_root: Path, tmp_path: Path) -> None:
    """GitOps renderers run `helm template`, where the chart cannot read the Secret it generated
    before: the helm source makes a new CA every render; existingSecret renders the same."""
    def webhook_objects(*values: str) -> list[dict]:
        return [o for o in render(helm4, repo_root, *values)
                if o["kind"] in ("Secret", "ValidatingWebhookConfiguration", "Deployment")]

    generated = [json.dumps(webhook_objects()) for _ in range(2)]
    assert generated[0] != generated[1]
    ca = base64.b64encode(b"-----BEGIN CERTIFICATE-----\n...\n-----END CERTIFICATE-----\n").decode()
    given = ("--set", "webhook.certificate.source=existingSecret",
             "--set", "webhook.certificate.existingSecret.name=afd-webhook-serving",
             "--set", f"webhook.certificate.existingSecret.caBundle={ca}")
    first, second = webhook_objects(*given), webhook_objects(*given)
    assert first == second and not find(first, "Secret")
    (config,) = find(first, "ValidatingWebhookConfiguration")
    assert {w["clientConfig"]["caBundle"] for w in config["webhooks"]} == {ca}
    (deployment,) = find(first, "Deployment")
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["webhook-tls"]["secret"]["secretName"] == "afd-webhook-serving"
    missing = helm4("template", RELEASE, str(repo_root / CHART), "--set", "webhook.certificate.source=existingSecret",
                    check=False)
    assert missing.returncode != 0 and "webhook.certificate.existingSecret.name" in missing.stderr, missing.stderr
