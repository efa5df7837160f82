"""`spec.transport.metaroce`: defaults equal the transport's own, and bad values are refused
with the field, the value and the fix."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from metaroce_api import InvalidObject, MetaRoceSettings, validate_network
from metaroce_api.network import METAROCE_DEFAULT_MTU, METAROCE_IPV4_OVERHEAD

REPO = Path(__file__).resolve().parents[3]
CORE = REPO / "transport/crates/metaroce-core/src"


def _rust_const(path: Path, name: str) -> int:
    m = re.search(rf"pub const {name}: \w+ = (\d+);", path.read_text())
    assert m, f"{name} not found in {path}"
    return int(m.group(1))


def _rust_default(field: str) -> str:
    """The expression `Config::default()` gives `field` in the transport's core."""
    text = (CORE / "endpoint.rs").read_text()
    body = text[text.index("impl Default for Config") :]
    m = re.search(rf"^\s*{field}: ([^,]+),", body, re.M)
    assert m, f"Config::default() has no {field}"
    return m.group(1).strip()


def _network(transport: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "metaroce.io/v1alpha1",
        "kind": "MetaRoceNetwork",
        "metadata": {"name": "lossy"},
        "spec": {
            "nics": {"interfaceNames": ["eth1"]},
            "transport": transport,
            "qos": {"profile": "lossy"},
            **spec,
        },
    }


def test_defaults_are_the_transports_own() -> None:
    d = MetaRoceSettings()
    assert str(d.paths) == _rust_default("paths")
    assert str(METAROCE_DEFAULT_MTU) == _rust_default("mtu")
    assert _rust_default("min_rto") == "5 * MS" and d.congestion.min_rto_micros == 5000
    assert _rust_default("rate_mbps") == "0" and d.congestion.rate_hint_mbps == 0
    aimd = CORE / "congestion/aimd.rs"
    assert d.congestion.queue_target_micros == _rust_const(aimd, "QUEUE_TARGET_US")
    assert d.paths <= _rust_const(CORE / "endpoint.rs", "MAX_PATHS")
    wire = CORE / "wire.rs"
    overhead = _rust_const(wire, "IPV4_UDP_OVERHEAD") + sum(
        _rust_const(wire, n) for n in ("HEADER_LEN", "DATA_HEADER_LEN", "CRC_LEN")
    )
    assert overhead == METAROCE_IPV4_OVERHEAD
    # the default range leaves the kernel's ephemeral ports alone and fits 250 endpoints
    assert d.port_range.last < 32768 and d.port_range.size // d.paths >= 250


def test_mss_sets_the_transports_datagram_size() -> None:
    assert MetaRoceSettings().datagram_size(None) == 1500
    assert MetaRoceSettings().datagram_size(9000) == 9000
    assert MetaRoceSettings(mss=8916).datagram_size(9000) == 9000


def test_unset_settings_mean_the_defaults() -> None:
    net = validate_network(_network({"mode": "metaroce"}))
    assert net.spec.transport.metaroce is None
    assert net.spec.transport.effective_metaroce() == MetaRoceSettings()


@pytest.mark.parametrize(
    ("transport", "path", "words"),
    [
        (
            {"mode": "metaroce", "metaroce": {"portRange": {"first": 30000, "last": 20000}}},
            "spec.transport.metaroce.portRange.last",
            ["last >= first"],
        ),
        (
            {"mode": "metaroce", "metaroce": {"portRange": {"first": 80, "last": 90}}},
            "spec.transport.metaroce.portRange.first",
            ["1024"],
        ),
        (
            {
                "mode": "metaroce",
                "metaroce": {"portRange": {"first": 20000, "last": 20007}, "paths": 16},
            },
            "spec.transport.metaroce.portRange",
            ["widen portRange or lower paths"],
        ),
        ({"mode": "metaroce", "metaroce": {"paths": 17}}, "spec.transport.metaroce.paths", ["16"]),
        (
            {"mode": "metaroce", "mtu": 1500, "metaroce": {"mss": 1417}},
            "spec.transport.metaroce.mss",
            ["lower mss", "raise transport.mtu"],
        ),
        (
            {"mode": "metaroce", "metaroce": {"congestion": {"minRtoMicros": 2_000_000}}},
            "spec.transport.metaroce.congestion.minRtoMicros",
            ["1000000"],
        ),
        (
            {"mode": "rocev2", "metaroce": {"paths": 4}},
            "spec.transport.metaroce",
            ["set mode: metaroce"],
        ),
        (
            {"mode": "auto", "metaroce": {"paths": 4}},
            "spec.transport.metaroce",
            ["auto never picks it"],
        ),
    ],
)
def test_bad_settings_name_field_value_and_fix(
    transport: dict[str, Any], path: str, words: list[str]
) -> None:
    with pytest.raises(InvalidObject) as err:
        validate_network(_network(transport))
    issues = [i for i in err.value.issues if i.path == path]
    assert issues, [str(i) for i in err.value.issues]
    text = str(issues[0])
    assert issues[0].value is not None, text
    for w in words:
        assert w in text, text


def test_lossless_stays_refused_with_metaroce() -> None:
    with pytest.raises(InvalidObject) as err:
        validate_network(_network({"mode": "metaroce"}, qos={"profile": "lossless"}))
    assert any(i.path == "spec.qos.profile" and "lossy" in i.message for i in err.value.issues)
