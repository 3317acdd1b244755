"""Eviction and admission: which chunks a tier keeps, ranked by the index's reuse
state, and what that ranking remembers across restarts (``docs/eviction.md``)."""
