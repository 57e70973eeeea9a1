"""The models: the target, the EAGLE drafter and its heads, checkpoints, paged KV, the CPU
decoder stack."""
