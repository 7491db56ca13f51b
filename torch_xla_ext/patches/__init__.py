"""Changes torch_xla_ext makes to other libraries, one module per library.

Each is installed once per process by the first call that needs it, never
at import, and docs/design.md lists them with why.
"""
