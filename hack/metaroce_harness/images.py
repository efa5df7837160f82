"""The project's container images, built without a registry by ``hack/build-images.sh``.

The script builds the agent, operator, RDMA test workload and pause images (buildah from
the Dockerfiles under ``images/``, on a base made by debootstrap) and exports each as an
OCI archive into ``${XDG_CACHE_HOME:-~/.cache}/metaroce/images/<key>/``. This module
runs it (a no-op when the images are cached) and describes the result::

    from metaroce_harness.images import find_images

    images = find_images()
    images.agent.ref        # "ghcr.io/metaroce/metaroce-agent:0.1.0"
    images.agent.archive    # Path to agent.tar (ctr image import / kind load image-archive)

``$METAROCE_IMAGES`` names a finished output directory to use as it is (no build).
"""

from __future__ import annotations

import logging
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("metaroce.harness.images")

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "hack" / "build-images.sh"
IMAGE_NAMES = ("agent", "operator", "rdma-test", "pause")


class ImageBuildError(RuntimeError):
    """The images are missing or their build failed; the message names the log."""


@dataclass(frozen=True)
class Image:
    name: str  # agent, operator, rdma-test or pause
    ref: str  # the image reference the archive carries
    archive: Path  # an OCI archive (tar)


@dataclass(frozen=True)
class ImageSet:
    root: Path
    version: str
    agent: Image
    operator: Image
    rdma_test: Image
    pause: Image
    # containerd's state with pause, agent and rdma-test unpacked (for the test nodes).
    node_state: Path
    # The agent's next version (a changed transport library), in node_state only: the
    # e2e's library upgrade under a running pod.
    agent_next_ref: str

    @property
    def all(self) -> tuple[Image, ...]:
        return (self.agent, self.operator, self.rdma_test, self.pause)

    @classmethod
    def from_dir(cls, root: Path) -> ImageSet:
        root = Path(root)
        manifest_path = root / "manifest.env"
        if not (root / ".complete").exists() or not manifest_path.exists():
            raise ImageBuildError(
                f"{root} is not a finished image build (no .complete or manifest.env): "
                f"run {BUILD_SCRIPT}"
            )
        manifest = dict(
            line.partition("=")[::2] for line in manifest_path.read_text().splitlines() if line
        )

        def image(name: str) -> Image:
            key = name.upper().replace("-", "_")
            ref = manifest.get(f"{key}_REF", "")
            archive = root / manifest.get(f"ARCHIVE_{name.replace('-', '_')}", f"{name}.tar")
            if not ref or not archive.is_file():
                raise ImageBuildError(
                    f"{manifest_path} names no {key}_REF or its archive {archive} is missing: "
                    f"rebuild with {BUILD_SCRIPT}"
                )
            return Image(name=name, ref=ref, archive=archive)

        return cls(
            root=root,
            version=manifest.get("VERSION", "?"),
            agent=image("agent"),
            operator=image("operator"),
            rdma_test=image("rdma-test"),
            pause=image("pause"),
            node_state=root / manifest.get("NODE_CONTAINERD_STATE", "node-containerd.tar"),
            agent_next_ref=manifest.get("AGENT_NEXT_REF", ""),
        )


def build_images() -> ImageSet:
    """Run ``hack/build-images.sh`` (quick when cached) and return what it built."""
    log.info("images: running %s", BUILD_SCRIPT)
    proc = subprocess.run(
        ["bash", str(BUILD_SCRIPT)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    for line in proc.stderr.splitlines():
        log.info("%s", line)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.splitlines()[-15:])
        raise ImageBuildError(f"{BUILD_SCRIPT} failed (exit {proc.returncode}):\n{tail}")
    return ImageSet.from_dir(Path(lines[-1]))


def find_images(build: bool = True) -> ImageSet:
    """The images: ``$METAROCE_IMAGES`` if set, else built (or reused) now."""
    env = os.environ.get("METAROCE_IMAGES")
    if env:
        return ImageSet.from_dir(Path(env))
    if not build:
        raise ImageBuildError(f"no images given: set METAROCE_IMAGES or run {BUILD_SCRIPT}")
    return build_images()
