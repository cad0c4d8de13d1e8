"""Batch schedulers the agent submits runs to instead of starting processes itself (Slurm)."""
