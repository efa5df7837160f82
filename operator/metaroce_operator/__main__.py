"""`python -m metaroce_operator [flags]` = `metaroce operator [flags]`."""

import sys

from metaroce_operator.cli import run_main

raise SystemExit(run_main(sys.argv[1:]))
