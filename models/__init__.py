"""Models built only on jaxkernels' public API."""
