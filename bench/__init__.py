"""jaxkernels benchmarks: python -m bench [suite ...] [--smoke]."""
