"""metaroce_agent: the MetaRoCE node agent (discover, plan, apply, verify, report, serve)."""

__version__ = "0.1.0"
