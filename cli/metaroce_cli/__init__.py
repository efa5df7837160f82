"""metaroce_cli."""
