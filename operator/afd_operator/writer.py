"""The one place where the operator writes to the Kubernetes API.

Every create/patch/delete goes through `Writer`, which counts it by verb and kind, treats
"already gone" as success, and "already exists" as success only when the deployment that is
creating it controls the existing object (a restarted operator finds what it made; anything
else raises `NameConflictError`, naming the holder), raises `ApiWriteError` (verb, kind, name
and the API's own status) for any other refusal,
and maps `policy/v1` PodDisruptionBudgets to `policy/v1beta1` on servers older than 1.21
(`server_version` tells the managers which newer fields the server keeps).
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor, as_completed
from datetime import datetime, timezone
from typing import Any, Callable, Mapping, Optional, Sequence

from kubernetes.client import ApiClient, VersionApi
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import ConflictError, NotFoundError, ResourceNotFoundError

from .api import API_VERSION, KIND
from .metrics import OperatorMetrics

log = logging.getLogger(__name__)
MERGE_PATCH = "application/merge-patch+json"
COMPONENT = "afd-operator"
# Requests `create_all` keeps in flight: enough that the API server, not one request's round
# trip after another, sets the pace of a large instance's creation; few enough to stay polite.
CREATE_CONCURRENCY = 16


class ApiWriteError(Exception):
    """The API refused a write: which one, and the API's status (code, reason, message)."""

    def __init__(self, verb: str, kind: str, name: str, code: int, reason: str, message: str):
        self.verb, self.kind, self.name = verb, kind, name
        self.code, self.reason, self.message = code, reason, message
        super().__init__(f"{verb} {kind} {name}: {code} {reason}: {message}")

    @classmethod
    def from_api(cls, verb: str, kind: str, name: str, err: ApiException) -> "ApiWriteError":
        # The body is a metav1.Status: its reason is one CamelCase word (Forbidden, Invalid, ...).
        try:
            status = json.loads(err.body or "{}")
        except (TypeError, ValueError):
            status = {}
        if not isinstance(status, dict):
            status = {}
        reason = status.get("reason") or (err.reason or "Unknown").replace(" ", "")
        return cls(verb, kind, name, int(err.status or 0), reason, status.get("message") or str(err.reason or ""))


class NameConflictError(ApiWriteError):
    """A child's name is held by an object its deployment does not control."""

    def __init__(self, kind: str, name: str, holder: str):
        self.holder = holder
        super().__init__("create", kind, name, 409, "NameConflict",
                         f"{kind} {name} exists and is controlled by {holder}, not by this AFDDeployment: the "
                         "operator neither adopts nor deletes it; rename this AFDDeployment or remove that object")


def _controller(meta: Mapping[str, Any]) -> Optional[Mapping[str, Any]]:
    return next((ref for ref in meta.get("ownerReferences") or () if ref.get("controller") is True), None)


def check_holder(desired: Mapping[str, Any], existing: Optional[Mapping[str, Any]]) -> None:
    """Raise NameConflictError unless `existing` (an object of `desired`'s name, None when there
    is none) is controlled by the same owner as `desired`."""
    wanted = _controller(desired["metadata"])
    if wanted is None or existing is None:  # no owner to compare, or gone since: the next round sees it
        return
    held = _controller(existing.get("metadata") or {})
    if held is not None and held.get("uid") == wanted.get("uid"):
        return
    holder = "nothing (no controller reference)" if held is None else \
        f"{held.get('kind')} {held.get('name')} (uid {held.get('uid')})"
    raise NameConflictError(desired["kind"], desired["metadata"]["name"], holder)


def controlled_by(existing: Optional[Mapping[str, Any]], kind: str, name: str) -> bool:
    """Whether `existing` is controlled by the object `kind`/`name` (a deletion by name must not
    take an object someone else holds)."""
    held = _controller((existing or {}).get("metadata") or {})
    return held is not None and held.get("kind") == kind and held.get("name") == name


class Writer:
    def __init__(self, api_client: ApiClient, metrics: OperatorMetrics):
        self.dyn = DynamicClient(api_client)
        self.metrics = metrics
        self._lock = threading.Lock()
        self._served: dict[tuple[str, str], bool] = {}
        self._server_version: Optional[tuple[int, int]] = None

    # -- discovery ----------------------------------------------------------------------
    def _resource(self, api_version: str, kind: str):
        return self.dyn.resources.get(api_version=api_version, kind=kind)

    def serves(self, api_version: str, kind: str) -> bool:
        key = (api_version, kind)
        with self._lock:
            if key not in self._served:
                try:
                    self._resource(api_version, kind)
                    self._served[key] = True
                except ResourceNotFoundError:
                    self._served[key] = False
            return self._served[key]

    def server_version(self) -> tuple[int, int]:
        """(major, minor) of the API server, read once: fields newer than the server are dropped
        by it, and a desired object holding one would be patched again every round."""
        with self._lock:
            if self._server_version is None:
                info = VersionApi(self.dyn.client).get_code()
                self._server_version = (int(info.major), int("".join(c for c in info.minor if c.isdigit())))
            return self._server_version

    def served_version(self, api_version: str, kind: str) -> str:
        if (api_version, kind) == ("policy/v1", "PodDisruptionBudget") and not self.serves(api_version, kind):
            return "policy/v1beta1"
        return api_version

    # -- reads used to avoid writes ------------------------------------------------------
    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Optional[dict[str, Any]]:
        version = self.served_version(api_version, kind)
        try:
            return self._resource(version, kind).get(name=name, namespace=namespace).to_dict()
        except NotFoundError:
            return None

    # -- writes ---------------------------------------------------------------------------
    def _count(self, verb: str, kind: str) -> None:
        self.metrics.api_writes.labels(verb, kind).inc()

    def create(self, obj: Mapping[str, Any]) -> None:
        version = self.served_version(obj["apiVersion"], obj["kind"])
        body = {**obj, "apiVersion": version}
        self._count("create", obj["kind"])
        try:
            # Not turned into objects: nothing reads the answer (a large instance's creation spent
            # as long on that as on the requests). Read, so the connection returns to the pool.
            self._resource(version, obj["kind"]).create(body=body, namespace=obj["metadata"].get("namespace"),
                                                        serialize=False).data
        except ConflictError:
            self._check_holder(obj, version)
        except ApiException as err:
            raise ApiWriteError.from_api("create", obj["kind"], obj["metadata"]["name"], err) from err

    def _check_holder(self, obj: Mapping[str, Any], version: str) -> None:
        """An object of the created one's name exists: fine if the same controller holds it."""
        meta = obj["metadata"]
        try:
            existing = self.get(version, obj["kind"], meta.get("namespace"), meta["name"])
        except ApiException as err:
            raise ApiWriteError.from_api("get", obj["kind"], meta["name"], err) from err
        check_holder(obj, existing)
        log.debug("%s %s already exists", obj["kind"], meta["name"])

    def create_all(self, objs: Sequence[Mapping[str, Any]], on_created: Callable[[Mapping[str, Any]], None]) -> None:
        """Create `objs` concurrently, at most CREATE_CONCURRENCY at a time, calling
        `on_created(obj)` (on this thread) for each one created. A refusal stops what is not sent
        yet; what is in flight finishes; then the first refusal is raised."""
        if len(objs) <= 1:
            for obj in objs:
                self.create(obj)
                on_created(obj)
            return
        refused: Optional[ApiWriteError] = None
        with ThreadPoolExecutor(max_workers=min(CREATE_CONCURRENCY, len(objs)),
                                thread_name_prefix="create") as pool:
            futures = {pool.submit(self.create, obj): obj for obj in objs}
            for future in as_completed(futures):
                if future.cancelled():
                    continue
                try:
                    future.result()
                except ApiWriteError as err:
                    refused = refused or err
                    for pending in futures:
                        pending.cancel()
                    continue
                on_created(futures[future])
        if refused is not None:
            raise refused

    def patch(self, api_version: str, kind: str, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        version = self.served_version(api_version, kind)
        self._count("patch", kind)
        try:
            self._resource(version, kind).patch(body=dict(patch), name=name, namespace=namespace,
                                                content_type=MERGE_PATCH)
        except NotFoundError:
            log.debug("%s %s vanished before patch", kind, name)
        except ApiException as err:
            raise ApiWriteError.from_api("patch", kind, name, err) from err

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        version = self.served_version(api_version, kind)
        self._count("delete", kind)
        try:
            self._resource(version, kind).delete(name=name, namespace=namespace)
        except NotFoundError:
            pass
        except ApiException as err:
            raise ApiWriteError.from_api("delete", kind, name, err) from err

    def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> Optional[str]:
        """Write the status subresource; returns the object's new resourceVersion."""
        self._count("patch", f"{KIND}/status")
        resource = self._resource(API_VERSION, KIND)
        try:
            result = resource.status.patch(body={"status": dict(status)}, name=name, namespace=namespace,
                                           content_type=MERGE_PATCH)
        except NotFoundError:
            return None
        except ApiException as err:
            raise ApiWriteError.from_api("patch", f"{KIND}/status", name, err) from err
        return result.metadata.resourceVersion

    def event(self, owner: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        meta = owner["metadata"]
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:12]}", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": API_VERSION, "kind": KIND, "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta.get("uid")},
            "type": type_, "reason": reason, "message": message[:1024],
            "source": {"component": COMPONENT}, "reportingComponent": COMPONENT,
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        self._count("create", "Event")
        try:
            self._resource("v1", "Event").create(body=body, namespace=meta["namespace"])
        except Exception:  # events are best effort: never fail a reconcile for one
            log.warning("could not post event %s: %s", reason, message, exc_info=True)
