"""The project's copy of the kubelet device-plugin api.proto is the pinned module's file.

The harness copies `pkg/apis/deviceplugin/v1beta1/api.proto` out of the pinned
`k8s.io/kubelet` module while it builds the Kubernetes binaries (hack/build-k8s.sh); this
compares it with `node-agent/metaroce_agent/deviceplugin/api.proto` below its header.
(Here, not in tests/unit, because it needs that build.)
"""

from __future__ import annotations

import difflib

from metaroce_agent.deviceplugin import gen
from metaroce_harness.cluster import ensure_binaries

MARKER = "// ---- upstream k8s.io/kubelet api.proto follows ----\n"


def test_api_proto_matches_the_pinned_kubelet_module() -> None:
    pinned = ensure_binaries().deviceplugin_proto.read_text()
    ours = gen.PROTO.read_text().partition(MARKER)[2]
    assert ours, f"{gen.PROTO} lost its marker line {MARKER.strip()!r}"
    diff = "".join(
        difflib.unified_diff(
            pinned.splitlines(keepends=True),
            ours.splitlines(keepends=True),
            "pinned k8s.io/kubelet api.proto",
            str(gen.PROTO),
        )
    )
    assert not diff, (
        "the device-plugin api.proto differs from the pinned k8s.io/kubelet module: copy the "
        "pinned file below the marker line, then run `python -m metaroce_agent.deviceplugin.gen`"
        f"\n{diff}"
    )
