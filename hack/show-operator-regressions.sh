#!/usr/bin/env bash
# Show that the regression tests of the operator review (issue 16) fail on the code
# before the fixes: a temporary git worktree of BASE (default b6733c0) gets this
# branch's versions of the test files, and the new tests run there against BASE's code
# (PYTHONPATH puts BASE's packages before this checkout's editable install). Every test
# listed must FAIL there; the script exits non-zero if one passes. Then the same tests
# run here, where they must pass.
#
#   bash hack/show-operator-regressions.sh            # unit + integration (cluster)
#   UNIT_ONLY=1 bash hack/show-operator-regressions.sh
#
# The integration tests start the local cluster (hack/setup.sh must have run); run this
# under the shared lock on a shared machine: flock /tmp/metaroce-heavy.lock bash ...
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo=$PWD
base=${BASE:-b6733c0}
py=$repo/.venv/bin/python

files=(
  tests/unit/webhooks/test_webhooks_server.py
  tests/unit/webhooks/flood_server.py
  tests/unit/webhooks/test_webhooks_mutate.py
  tests/unit/webhooks/test_webhooks_validate.py
  tests/unit/operator/test_taints.py
  tests/unit/operator/test_conflicts.py
  tests/unit/operator/test_leader.py
  tests/unit/operator/test_cli.py
  tests/unit/operator/test_status.py
  tests/integration/chart/test_chart.py
  tests/integration/chart/test_agent_policy.py
  tests/integration/operator/test_leader_lease.py
  tests/integration/operator/test_operator_review_fixes.py
)
unit_tests=(
  "tests/unit/webhooks/test_webhooks_server.py::test_health_and_unsynced_cache"
  "tests/unit/webhooks/test_webhooks_server.py::test_internal_errors_are_http_errors_so_the_failure_policy_decides"
  "tests/unit/webhooks/test_webhooks_mutate.py::test_the_container_that_holds_the_resource_gets_ipc_lock_and_the_nccl_env"
  "tests/unit/webhooks/test_webhooks_mutate.py::test_an_init_container_that_holds_the_resource_is_considered"
  "tests/unit/webhooks/test_webhooks_mutate.py::test_each_network_s_settings_go_to_the_container_holding_its_resource"
  "tests/unit/webhooks/test_webhooks_mutate.py::test_the_named_container_can_be_an_init_container"
  "tests/unit/webhooks/test_webhooks_mutate.py::test_node_health_is_not_admission_s_business"
  "tests/unit/operator/test_taints.py::test_taints_of_networks_that_no_longer_exist_are_orphans"
  "tests/unit/operator/test_taints.py::test_a_deleted_network_s_taint_does_not_count_toward_another_s_cap"
  "tests/unit/webhooks/test_webhooks_validate.py::test_conflicting_networks_stay_editable_issue_16_9"
  "tests/unit/operator/test_conflicts.py::test_selectors_on_different_attributes_are_decided_from_the_reports_issue_16_3"
  "tests/unit/operator/test_conflicts.py::test_a_reported_nic_that_both_select_is_a_conflict_issue_16_3"
  "tests/unit/webhooks/test_webhooks_validate.py::test_agent_images_come_from_the_allowlist_issue_16_11"
  "tests/unit/operator/test_cli.py::test_agent_image_allowlist_holds_the_default_image_and_the_flags_issue_16_11"
  "tests/unit/operator/test_conflicts.py::test_two_networks_advertising_one_resource_conflict_issue_16_10"
  "tests/unit/operator/test_status.py::test_ready_threshold_from_the_spec_issue_16_10"
)
integration_tests=(
  "tests/integration/operator/test_operator_review_fixes.py::test_cleanup_finalizer_waits_for_the_first_nodestate_list"
  "tests/integration/operator/test_operator_review_fixes.py::test_deleting_a_network_removes_its_taints"
  "tests/integration/operator/test_operator_review_fixes.py::test_cleanup_finalizer_is_added_before_any_child"
  "tests/integration/operator/test_operator_review_fixes.py::test_foreground_deletion_keeps_the_agents_until_they_reverted"
  "tests/integration/operator/test_operator_review_fixes.py::test_operator_refuses_agent_images_not_on_its_allowlist"
  "tests/integration/operator/test_operator_review_fixes.py::test_edited_children_are_restored_without_a_rollout_loop"
  "tests/integration/chart/test_chart.py::test_default_roles_get_read_access_only_issue_16_11"
  "tests/integration/chart/test_chart.py::test_agent_image_allowlist_value_issue_16_11"
  "tests/integration/chart/test_agent_policy.py::test_an_agent_writes_only_its_own_node_s_nodestate"
  "tests/integration/operator/test_leader_lease.py::test_leadership_is_counted_from_when_the_write_was_sent"
)
# Add the tests of later fixes here as they land (see the issue-16 report).
extra_file=hack/operator-regressions.txt
if [[ -f $extra_file ]]; then
  while read -r tier test; do
    [[ -z ${tier:-} || $tier == \#* ]] && continue
    if [[ $tier == unit ]]; then unit_tests+=("$test"); else integration_tests+=("$test"); fi
    files+=("${test%%::*}")
  done <"$extra_file"
fi
tests=("${unit_tests[@]}")
[[ ${UNIT_ONLY:-0} == 1 ]] || tests+=("${integration_tests[@]}")

wt=$(mktemp -d /tmp/metaroce-regressions-XXXXXX)
git worktree add --quiet --detach "$wt" "$base" || exit 1
trap 'git -C "$repo" worktree remove --force "$wt"' EXIT
for f in "${files[@]}"; do
  [[ -f $f ]] && cp "$f" "$wt/$f"
done
ln -s "$repo/.venv" "$wt/.venv"

where=$(cd "$wt" && PYTHONPATH="$wt/api:$wt/operator:$wt/node-agent:$wt/hack:$wt/cli" \
  "$py" -c 'import metaroce_operator; print(metaroce_operator.__file__)')
echo "== on $base ($(git rev-parse --short "$base")): the code under test is $where"
[[ $where == "$wt"/* ]] || { echo "ERROR: not testing $base's code"; exit 1; }

unexpected=0
for t in "${tests[@]}"; do
  out=$(cd "$wt" && PYTHONPATH="$wt/api:$wt/operator:$wt/node-agent:$wt/hack:$wt/cli" \
    "$py" -m pytest -q -p no:cacheprovider "$t" 2>&1)
  rc=$?
  if ((rc == 0)); then
    echo "PASSES (unexpected) on $base: $t"
    unexpected=1
  else
    why=$(grep -m1 -E '^E +' <<<"$out" | sed -E 's/^E +//' | cut -c1-150)
    echo "FAILS on $base: $t"
    echo "    ${why:-$(tail -1 <<<"$out")}"
  fi
done

echo "== on this checkout ($(git rev-parse --short HEAD)):"
"$py" -m pytest -q -p no:cacheprovider "${tests[@]}" 2>&1 | grep -E "^(FAILED|ERROR|E  )|passed|failed" | tail -25
rc=${PIPESTATUS[0]}
((unexpected == 0 && rc == 0))
