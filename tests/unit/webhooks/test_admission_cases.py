"""The shared admission cases (tests/fixtures/admission_cases.py) through the pod
webhook's pure mutation. The same cases run against the real apiserver in both admission
modes in tests/integration/test_pod_admission_modes.py; the policies' CEL can only run
there (no CEL evaluator with Kubernetes' libraries outside the apiserver)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from webhook_testlib import apply_patch, view, views

from metaroce_operator.webhooks.mutate import Allowed, Denied, Namespace, mutate_pod

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "fixtures"))
from admission_cases import BE_SPEC, CASES, Case, Names, fe_spec

NAMES = Names("backend", "frontend")
NETS = views(view(NAMES.be, **BE_SPEC), view(NAMES.fe, **fe_spec(NAMES.r_fe)))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_case_through_the_webhook_mutation(case: Case) -> None:
    labels = {"kubernetes.io/metadata.name": "jobs"}
    if case.pod_security:
        labels["pod-security.kubernetes.io/enforce"] = case.pod_security
    pod = case.pod(NAMES, "trainer-0")
    decision = mutate_pod(pod, NETS, Namespace("jobs", labels))
    if case.refused:
        assert isinstance(decision, Denied), decision
        for word in case.refused:
            assert NAMES.fill(word) in decision.message, decision.message
        return
    assert isinstance(decision, Allowed), decision
    assert case.check is not None
    case.check(apply_patch(pod, decision.patch), NAMES)
