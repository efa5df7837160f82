"""`python3 -m metaroce_agent {agent|doctor} ...`."""

from metaroce_agent.cli import main

raise SystemExit(main())
