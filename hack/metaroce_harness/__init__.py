"""metaroce_harness."""
