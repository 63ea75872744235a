"""How xla-fp4 warns: one line per warning, `xla_fp4: ...`, and nothing else.

`warnings.warn` prints the source line of the code that warned below the message: the pass's own line (or the user's,
whichever stacklevel finds), which says nothing to a user. These warnings name no source line: Python's filters
(`-W error`, `warnings.catch_warnings`) still see them, attributed to the module `xla_fp4`."""

import warnings


def warn(message, category=UserWarning):
  warnings.warn_explicit(message, category, filename="xla_fp4", lineno=0, module="xla_fp4")
