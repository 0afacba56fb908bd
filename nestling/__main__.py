"""`python -m nestling COMMAND`: the `nestling` command without its console script (e.g. in a fresh venv)."""

from nestling.cli import main

raise SystemExit(main())
