"""The pure planning parts of fabric.py: the nftables script and input validation."""

from __future__ import annotations

import fabric
import pytest

pytestmark = pytest.mark.transport

LINKS = ["d0", "d1", "d2", "d3"]


def test_ruleset_counts_every_link_and_drops_only_where_asked() -> None:
    text = fabric.nft_ruleset(LINKS, [fabric.Impairment("drop", 100, link=3)])
    for d in LINKS:
        assert f'iifname "{d}" counter name seen_{d}' in text
        assert f"counter drop_{d} {{ }}" in text and f"counter ce_{d} {{ }}" in text
    assert 'iifname "d3" numgen random mod 10000 < 100 counter name drop_d3 drop' in text
    assert "drop_d0 drop" not in text
    assert "hook prerouting priority -300" in text  # ingress, before routing


def test_ruleset_ce_matches_only_ect_and_full_rates_need_no_draw() -> None:
    text = fabric.nft_ruleset(
        LINKS, [fabric.Impairment("ce", 10000), fabric.Impairment("drop", 10000)]
    )
    assert 'iifname "d1" ip ecn { ect0, ect1 } counter name ce_d1 ip ecn set ce' in text
    assert 'iifname "d2" counter name drop_d2 drop' in text
    assert "mod 10000 < 10000" not in text


def test_burst_rule_drops_runs_of_the_asked_length() -> None:
    imp = fabric.Impairment("burst", 100, burst_len=16)
    assert fabric.burst_period(imp) == 1600
    text = fabric.nft_ruleset(LINKS, [imp])
    assert "numgen inc mod 1600 >= 1584 meta mark set" in text
    assert text.count("meta mark set 0 counter name drop_") == 4


@pytest.mark.parametrize(
    "imp,field",
    [
        (fabric.Impairment("loss", 1), "kind='loss'"),
        (fabric.Impairment("drop", 10001), "per10000=10001"),
        (fabric.Impairment("drop", 1, link=4), "link=4"),
        (fabric.Impairment("blackhole"), "name one link"),
        (fabric.Impairment("burst", 100, burst_len=0), "burst_len=0"),
    ],
)
def test_bad_impairments_name_the_field(imp: fabric.Impairment, field: str) -> None:
    with pytest.raises(ValueError, match=field.replace("(", r"\(")):
        fabric.nft_ruleset(LINKS, [imp])


def test_names_and_prefixes_are_validated() -> None:
    with pytest.raises(ValueError, match="prefix='Bad-'"):
        fabric.new_name("Bad-")
    with pytest.raises(ValueError, match="name='x'"):
        fabric.MultipathFabric(name="x")
    with pytest.raises(ValueError, match="mtu=100"):
        fabric.MultipathFabric(name=fabric.new_name(), mtu=100)
    assert fabric.parse_route_dev("10.200.0.2 from 10.200.0.1 dev d3 uid 0") == "d3"
