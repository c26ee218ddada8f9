"""`python -m multirun_analysis`: see cli.py."""

import sys

from .cli import main

try:
    raise SystemExit(main())
except KeyboardInterrupt:  # Ctrl-C: a line and the usual exit status, not a traceback
    print("multirun_analysis: interrupted", file=sys.stderr)
    raise SystemExit(130) from None
