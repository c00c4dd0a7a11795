"""GPU quotas: the policy (`policy`, pure functions of quotas and holdings) and the ledger
(`ledger`, the database rows of quotas, devices, allocations and the audit trail, and the
transactions that admit and release GPUs for notebook servers and training jobs alike)."""
