"""The samples a user applies first are valid and safe (issue 17, item 2): the Mellanox one
names its interfaces, tolerates GPU-node taints and changes no MTU by default."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from metaroce_api import MetaRoceNetwork

SAMPLES = Path(__file__).resolve().parents[3] / "samples"


@pytest.mark.parametrize("path", sorted(SAMPLES.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_sample_is_a_valid_network(path: Path) -> None:
    MetaRoceNetwork.model_validate(yaml.safe_load(path.read_text()))


def test_mellanox_sample_is_safe_on_a_real_cluster() -> None:
    text = (SAMPLES / "rocev2-lossless-mellanox.yaml").read_text()
    net = MetaRoceNetwork.model_validate(yaml.safe_load(text))
    assert net.spec.nics.interface_names, "explicit interface names, not every mlx5 NIC"
    assert "PLACEHOLDER" in text  # the user is told to put their own names there
    assert not net.spec.nics.allow_primary_interface
    assert net.spec.transport.mtu is None, "no MTU change unless the user asks"
    assert any(t.key == "nvidia.com/gpu" for t in net.spec.tolerations or [])
