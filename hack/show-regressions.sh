#!/usr/bin/env bash
# Issue 15's regression tests against the code before the fixes: each test file below
# runs once over a clean export of BASE (default b6733c0, the commit the issue was filed
# against) and once over this checkout. Expected: they fail on BASE (except the guards
# named in EXPECTED_TO_PASS_ON_BASE) and pass here. Unit tests only: no cluster, no lock.
#   bash hack/show-regressions.sh [BASE]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo=$PWD
base=${1:-b6733c0}
tests=(
  tests/unit/agent/test_agent_reapply.py  # finding 1: a failed re-apply restores the verified state
  tests/unit/agent/test_agent_dcb_app.py  # finding 3: DCB APP entries follow a DSCP change
  tests/unit/agent/test_agent_retry.py    # finding 2: retry with backoff, re-plan on new devices
  tests/unit/agent/test_agent_journal.py  # finding 4: durable journal, no invented originals
  tests/unit/agent/test_agent_software_rdma.py  # finding 5: rxe matched by its driver
  tests/unit/agent/test_agent_fixture_mode.py   # finding 11: no silent fixture mode
  tests/unit/agent/test_agent_modules.py  # finding 6: verbs modules loaded, rdma_cm only if there
  tests/unit/agent/test_agent_probe_server.py  # finding 7 (server side): concurrent, deadlines, cap
  tests/unit/agent/test_agent_probe_endpoint.py  # finding 9: no 0.0.0.0 endpoint, republished, IPv6
  tests/unit/agent/test_agent_probe_auth.py   # finding 7 (auth): HMAC with nonces, both ways
  tests/unit/agent/test_agent_probe_stats.py  # finding 8: enough samples, Wilson bound, hysteresis
  tests/unit/agent/test_agent_probe_count.py  # finding 8: the UD count waits on completions
  tests/unit/agent/test_agent_probe_peers.py  # finding 10: metadata-only peer index, watched
  tests/unit/agent/test_agent_probe_rails.py  # finding 10: every served device probed
  tests/unit/agent/test_agent_rxe_users.py    # finding 12: rxe users seen without hostPID
  tests/unit/agent/test_agent_exporter_render.py  # bench items: what /metrics serves, escaped
  tests/unit/agent/test_agent_health_endpoints.py  # issue 16 #15: /readyz = verified, /livez
  tests/unit/agent/test_agent_node_label.py  # finding 4: the operator's label asks for a revert
  tests/unit/agent/test_agent_rollback.py  # fault cases: a failed rollback Degraded and retried,
  # only knobs really off their verified value left off, the verified state in force served
)
# the tests' own fixtures (additions only) go along with them
support=(tests/unit/agent/fakes.py tests/unit/agent/conftest.py)
# guards of an upgrade path, not regressions: they pass on BASE and must keep passing; and
# unit tests of a new module's pure helpers (probe_auth), which the editable install of
# this checkout serves to BASE's package too (its regression tests fail there)
EXPECTED_TO_PASS_ON_BASE="test_the_mac_binds_both_nonces_and_every_field
test_a_key_file_is_checked_with_an_error_naming_it_and_the_fix
test_a_journal_with_one_step_for_all_entries_is_read_per_entry
test_siw_on_the_netdev_is_not_adopted_as_the_rxe_link
test_odd_files_are_skipped_in_what_is_served
test_the_keys_are_the_key_file_and_the_previous_one_beside_it"

[[ -x .venv/bin/pytest ]] || { echo "run hack/setup.sh first (.venv)" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git archive "$base" | tar -x -C "$tmp"
for t in "${tests[@]}" "${support[@]}"; do cp "$t" "$tmp/$t"; done

run() {  # DIR: the test files over DIR's packages (PYTHONPATH wins over the editable install)
  (cd "$1" && PYTHONPATH=api:operator:node-agent:hack:cli timeout 600 \
    "$repo/.venv/bin/pytest" -q -p no:cacheprovider --tb=no -rA --continue-on-collection-errors \
    "${tests[@]}" 2>&1 \
    | grep -E '^(PASSED|FAILED|ERROR) ' | sed -E 's/ - .*//' | sort) || true
}

echo "== on $base ($(git rev-parse --short "$base"))"
on_base=$(run "$tmp")
echo "$on_base"
echo "== on this checkout ($(git rev-parse --short HEAD)$(git diff --quiet || echo ', with local changes'))"
here=$(run "$repo")
echo "$here"

bad=0
while read -r outcome name; do
  [[ -n $name ]] || continue
  short=${name##*::}
  if [[ $outcome == PASSED ]] && ! grep -qxF "$short" <<<"$EXPECTED_TO_PASS_ON_BASE"; then
    echo "NOT A REGRESSION TEST: $name passes on $base" >&2; bad=1
  fi
done <<<"$on_base"
if grep -qE '^(FAILED|ERROR) ' <<<"$here"; then echo "FAILING HERE: see above" >&2; bad=1; fi
((bad == 0)) && echo "== every regression test fails on $base and passes here"
exit "$bad"
