"""Regenerate the gRPC stubs of the kubelet device-plugin API from `api.proto` (and of
the PodResources API from `podresources.proto`).

    python -m metaroce_agent.deviceplugin.gen            # rewrite the committed stubs
    python -m metaroce_agent.deviceplugin.gen --out DIR  # write them under DIR instead

The proto is compiled with the package root (`node-agent/`) as include path, so the
generated `api_pb2_grpc.py` imports `metaroce_agent.deviceplugin.api_pb2` (absolute) and
the stubs work as part of the package. The gRPC service names stay `v1beta1.Registration`
and `v1beta1.DevicePlugin`, which is what the kubelet speaks. Needs `grpcio-tools` (the
`dev` extra); a unit test regenerates into a temporary directory and fails when the
committed files differ.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
PACKAGE_ROOT = PACKAGE_DIR.parent.parent
"""`node-agent/`: the include root, so the proto is `metaroce_agent/deviceplugin/api.proto`."""
PROTO = PACKAGE_DIR / "api.proto"
PODRESOURCES_PROTO = PACKAGE_DIR / "podresources.proto"
GENERATED = (
    "api_pb2.py",
    "api_pb2_grpc.py",
    "podresources_pb2.py",
    "podresources_pb2_grpc.py",
)


def generate(out_root: Path) -> list[Path]:
    """Compile the protos into `out_root/metaroce_agent/deviceplugin/`; returns the files."""
    try:
        from grpc_tools import protoc
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "grpc_tools is missing: install grpcio-tools (pip install -e '.[dev]')"
        ) from exc
    import importlib.resources

    rels = [p.relative_to(PACKAGE_ROOT) for p in (PROTO, PODRESOURCES_PROTO)]
    out_dir = out_root / rels[0].parent
    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    argv = [
        "grpc_tools.protoc",
        f"-I{PACKAGE_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(str(rel) for rel in rels),
    ]
    # protoc resolves the file argument against the include path; run from the root.
    import os

    cwd = os.getcwd()
    os.chdir(PACKAGE_ROOT)
    try:
        code = protoc.main(argv)
    finally:
        os.chdir(cwd)
    if code != 0:
        raise RuntimeError(f"protoc failed (exit {code}) on {PROTO}: see its message above")
    return [out_dir / name for name in GENERATED]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m metaroce_agent.deviceplugin.gen", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=PACKAGE_ROOT,
        help="root to write metaroce_agent/deviceplugin/*_pb2*.py under (default: the source tree)",
    )
    args = parser.parse_args(argv)
    try:
        files = generate(args.out)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for path in files:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
