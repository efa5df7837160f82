#!/usr/bin/env bash
# The main job on a fresh machine: set up, start the local cluster, install the
# operator and a sample network, and print what it did. See README.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash hack/setup.sh
exec .venv/bin/python -m metaroce_harness.demo "$@"
