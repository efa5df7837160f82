"""One operator per network (issue 16 #16), the pure part: the claim annotation, its
patch (guarded by the resourceVersion) and kopf's per-namespace bookkeeping prefix.
The behaviour with two real operators is tests/integration/operator/test_operator_claim.py.

On b6733c0 (and until this fix) there is no claim: a second release reconciles every
network too."""

from __future__ import annotations

from metaroce_operator.claim import (
    CLAIM_ANNOTATION,
    claim_patch,
    claimant,
    kopf_prefix,
    split_claim,
)


def test_the_claim_names_the_claimant_s_lease_and_is_written_against_the_version_read() -> None:
    body = {"metadata": {"name": "net", "resourceVersion": "41", "annotations": {}}}
    assert claimant(body) is None
    patch = claim_patch(body, "ns-a/metaroce-operator")
    assert patch == {
        "metadata": {
            "resourceVersion": "41",
            "annotations": {CLAIM_ANNOTATION: "ns-a/metaroce-operator"},
        }
    }
    claimed = {"metadata": {"annotations": {CLAIM_ANNOTATION: "ns-a/metaroce-operator"}}}
    assert claimant(claimed) == "ns-a/metaroce-operator"
    assert split_claim("ns-a/metaroce-operator") == ("ns-a", "metaroce-operator")
    assert split_claim("garbage") is None and split_claim("a/b/c") is None


def test_two_releases_keep_their_kopf_bookkeeping_apart() -> None:
    assert kopf_prefix("metaroce-system", "metaroce-system") == "operator.metaroce.io"
    other = kopf_prefix("team-b", "metaroce-system")
    assert other != "operator.metaroce.io" and other.endswith(".metaroce.io")
