"""GPU quotas: the policy (`policy`, pure functions of quotas and holdings), the queue's policy
(`queue`, a pure scheduling pass: fair share, gang admission, backfill, borrowing and
preemption) and the ledger (`ledger`, the database rows of quotas, devices, allocations and the
audit trail, and the transactions that admit and release GPUs for notebook servers and training
jobs alike)."""
