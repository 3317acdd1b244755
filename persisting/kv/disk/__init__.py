"""The disk tier: one self-describing payload file per chunk, a Lance metadata table,
and what keeps them true to each other (checksums, quarantine, reconciliation at open)."""
