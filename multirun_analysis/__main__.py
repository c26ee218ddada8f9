"""`python -m multirun_analysis`: see cli.py."""

from .cli import main

raise SystemExit(main())
