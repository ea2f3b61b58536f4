"""The cluster DNS feeder: list+watch Services and Endpoints, write dnsmasq's hosts file.

dnsmasq (Debian's dnsmasq-base) serves the file from a watched folder, so each rewrite is
live at once. Served: A and PTR records for `<service>.<ns>.svc.<domain>` (the ClusterIP,
or every ready address of a headless Service, not-ready ones too when the Service publishes
them) and `<hostname>.<service>.<ns>.svc.<domain>` for endpoints carrying a hostname (pods
with `hostname` + `subdomain`). Not served: SRV records, pod-IP names (`a-b-c-d.<ns>.pod`),
ExternalName CNAMEs, names outside the cluster domain.

Run: python -m afd_devcluster.realnode.dns --kubeconfig FILE --hosts-file FILE [--domain D]
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from kubernetes import client, config, watch

RETRY_SECONDS = 1.0


def host_records(services: dict[str, Any], endpoints: dict[str, Any], domain: str) -> list[tuple[str, str]]:
    """(ip, name) pairs for the hosts file, from Service and Endpoints objects keyed ns/name."""
    records: list[tuple[str, str]] = []
    for key, svc in sorted(services.items()):
        ns, name = key.split("/", 1)
        fqdn = f"{name}.{ns}.svc.{domain}"
        cluster_ip = svc.spec.cluster_ip
        if cluster_ip and cluster_ip != "None":
            records.append((cluster_ip, fqdn))
            continue
        ep = endpoints.get(key)
        for subset in (ep.subsets or []) if ep else []:
            addresses = list(subset.addresses or [])
            if svc.spec.publish_not_ready_addresses:
                addresses += subset.not_ready_addresses or []
            for address in addresses:
                records.append((address.ip, fqdn))
                if address.hostname:
                    records.append((address.ip, f"{address.hostname}.{fqdn}"))
    return records


def write_hosts(path: Path, records: list[tuple[str, str]]) -> None:
    """Replace the file in one rename, so dnsmasq never reads half of it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(f"{ip} {name}\n" for ip, name in records))
    os.replace(tmp, path)


class Feeder:
    def __init__(self, api: client.ApiClient, hosts_file: Path, domain: str):
        self.core = client.CoreV1Api(api)
        self.hosts_file = hosts_file
        self.domain = domain
        self.objects: dict[str, dict[str, Any]] = {"services": {}, "endpoints": {}}
        self.lock = threading.Lock()

    def _write(self) -> None:
        with self.lock:
            write_hosts(self.hosts_file,
                        host_records(self.objects["services"], self.objects["endpoints"], self.domain))

    def _follow(self, kind: str, lister: Callable[..., Any]) -> None:
        while True:
            try:
                listed = lister()
                with self.lock:
                    self.objects[kind] = {f"{o.metadata.namespace}/{o.metadata.name}": o for o in listed.items}
                self._write()
                for event in watch.Watch().stream(lister, resource_version=listed.metadata.resource_version,
                                                  timeout_seconds=300):
                    obj = event["object"]
                    key = f"{obj.metadata.namespace}/{obj.metadata.name}"
                    with self.lock:
                        if event["type"] == "DELETED":
                            self.objects[kind].pop(key, None)
                        else:
                            self.objects[kind][key] = obj
                    self._write()
            except Exception as err:  # the API server restarts or expires the watch: list again
                print(f"dns feeder: {kind}: {err!r}; listing again", flush=True)
                time.sleep(RETRY_SECONDS)

    def run(self) -> None:
        threads = [threading.Thread(target=self._follow, args=(kind, lister), daemon=True)
                   for kind, lister in (("services", self.core.list_service_for_all_namespaces),
                                        ("endpoints", self.core.list_endpoints_for_all_namespaces))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--hosts-file", required=True, type=Path)
    parser.add_argument("--domain", default="cluster.local")
    args = parser.parse_args()
    Feeder(config.new_client_from_config(config_file=args.kubeconfig), args.hosts_file, args.domain).run()


if __name__ == "__main__":
    main()
