#!/usr/bin/env bash
# Print the app version: charts/metaroce/Chart.yaml's appVersion is the one source of
# the images' tags and the chart's defaults.
set -euo pipefail
sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\} *$/\1/p' "$(dirname "${BASH_SOURCE[0]}")/../charts/metaroce/Chart.yaml"
