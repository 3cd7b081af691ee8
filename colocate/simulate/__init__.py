"""`colocate simulate`: each way to run a job predicted on a GPU node, from measured constants (docs/simulate.md)."""
