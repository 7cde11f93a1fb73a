"""The async runtime: the ledger facade, runs, tools and settlement."""
