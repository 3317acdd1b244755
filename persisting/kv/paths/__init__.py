"""The store's operations over both tiers: puts, reads, lookups, read leases, and the
load-or-recompute plan."""
