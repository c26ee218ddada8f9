"""`python -m multirun_analysis`: see cli.py."""

import sys

try:  # the import too: under load, Ctrl-C came in it and left a KeyboardInterrupt traceback
    from .cli import main

    raise SystemExit(main())
except KeyboardInterrupt:  # Ctrl-C: a line and the usual exit status, not a traceback
    print("multirun_analysis: interrupted", file=sys.stderr)
    raise SystemExit(130) from None
