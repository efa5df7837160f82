"""metaroce_api: the contract every MetaRoCE component imports."""
