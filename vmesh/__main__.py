"""`python -m vmesh ...`: the `vmesh` command."""

from vmesh.services.cli import main

raise SystemExit(main())
