"""Changes torch_xla_ext makes to other libraries, one module per library
(`torch_xla`, `torch`, `transformers`, `peft`), on one mechanism (`patching`).

A module here holds the mechanics of its library's changes: what is wrapped,
replaced or registered, made once per process (thread-safe) by the first
call that needs it, never at import, and when the library is imported (now
if it is). What a change does is a callable passed in by the package that
needs it, so this package imports none of the packages that use it.
docs/design.md lists every change with why, when it is installed, and
whether and when it is undone.
"""
