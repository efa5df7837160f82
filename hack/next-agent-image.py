"""The agent image's next version, as an OCI archive, for the e2e's library upgrade.

    python3 hack/next-agent-image.py AGENT_TAR TRANSPORT_DIR REF OUT_TAR

AGENT_TAR is the agent's OCI archive with uncompressed layers (hack/build-images.sh makes
it), TRANSPORT_DIR the transport it carries (images/agent/transport). OUT_TAR gets the same
image, tagged REF, plus one layer that changes the transport as a new release would:
VERSION gains "+next" and every lib/*.so gets a note appended past its end (the dynamic
loader maps only what the ELF headers point at), so the agent sees another version and
checksum and installs it beside the first. The base layers are the agent's own blobs, so
one containerd stores them once. Written here rather than with `buildah push`, which
would compress every layer of the image again (minutes on two cores).
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
import tarfile
from pathlib import Path
from typing import Any

IMAGE_DIR = "opt/metaroce/transport"  # the agent image's transport (library.IMAGE_DIR)
NOTE = b"\0metaroce-e2e-next\0"
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar"


def layer_tar(transport: Path) -> bytes:
    """The new layer: VERSION and the libraries, changed; parent directories as in the
    image (root-owned, 0755)."""
    version = (transport / "VERSION").read_text().strip()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:

        def add(name: str, data: bytes | None, mode: int) -> None:
            info = tarfile.TarInfo(name)
            info.mode, info.uid, info.gid, info.mtime = mode, 0, 0, 0
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))

        parts = IMAGE_DIR.split("/")
        for i in range(1, len(parts) + 1):
            add("/".join(parts[:i]), None, 0o755)
        add(f"{IMAGE_DIR}/VERSION", f"{version}+next\n".encode(), 0o644)
        add(f"{IMAGE_DIR}/lib", None, 0o755)
        for so in sorted((transport / "lib").glob("*.so")):
            add(f"{IMAGE_DIR}/lib/{so.name}", so.read_bytes() + NOTE, so.stat().st_mode & 0o777)
    return buf.getvalue()


def blob_name(data: bytes) -> tuple[str, str]:
    digest = hashlib.sha256(data).hexdigest()
    return f"sha256:{digest}", f"blobs/sha256/{digest}"


def main(agent_tar: str, transport_dir: str, ref: str, out_tar: str) -> int:
    with tarfile.open(agent_tar) as src:

        def read_json(name: str) -> Any:
            f = src.extractfile(name)
            if f is None:
                raise SystemExit(f"{agent_tar}: no {name}")
            return json.load(f)

        index = read_json("index.json")
        if len(index["manifests"]) != 1:
            raise SystemExit(f"{agent_tar}: expected one image, found {len(index['manifests'])}")
        entry = index["manifests"][0]
        manifest = read_json("blobs/sha256/" + entry["digest"].split(":", 1)[1])
        config = read_json("blobs/sha256/" + manifest["config"]["digest"].split(":", 1)[1])
        if any(layer["mediaType"] != LAYER_TYPE for layer in manifest["layers"]):
            raise SystemExit(f"{agent_tar}: compressed layers (run build-images.sh's uncompress)")

        layer = layer_tar(Path(transport_dir))
        layer_digest, layer_name = blob_name(layer)
        config["rootfs"]["diff_ids"].append(layer_digest)
        config.setdefault("history", []).append(
            {"created_by": "hack/next-agent-image.py: the transport's next version"}
        )
        config_data = json.dumps(config, separators=(",", ":")).encode()
        config_digest, config_name = blob_name(config_data)
        manifest["config"].update(digest=config_digest, size=len(config_data))
        manifest["layers"].append(
            {"mediaType": LAYER_TYPE, "digest": layer_digest, "size": len(layer)}
        )
        manifest_data = json.dumps(manifest, separators=(",", ":")).encode()
        manifest_digest, manifest_name = blob_name(manifest_data)
        new_entry = dict(entry, digest=manifest_digest, size=len(manifest_data))
        new_entry["annotations"] = {"org.opencontainers.image.ref.name": ref}
        index_data = json.dumps(dict(index, manifests=[new_entry]), separators=(",", ":")).encode()

        with tarfile.open(out_tar + ".tmp", "w") as out:
            for member in src:  # the agent's blobs and oci-layout, streamed
                if member.name == "index.json":
                    continue
                out.addfile(member, src.extractfile(member) if member.isfile() else None)
            for name, data in (
                (layer_name, layer),
                (config_name, config_data),
                (manifest_name, manifest_data),
                ("index.json", index_data),
            ):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                out.addfile(info, io.BytesIO(data))
    Path(out_tar + ".tmp").rename(out_tar)
    print(f"{out_tar}: {ref}, one layer of {len(layer)} B on the agent's")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 5:
        raise SystemExit(__doc__)
    raise SystemExit(main(*sys.argv[1:]))
