"""Flash attention: api (validation, dispatch, custom_vjp), reference (the spec, also "xla"),
common (the masks every backend applies), and one module per kernel backend."""
