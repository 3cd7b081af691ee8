"""Benchmarks (`colocate bench sync|switch`): every figure is measured beside its floor in the same run."""
