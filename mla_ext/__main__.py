"""`python -m mla_ext ...` (see mla_ext.cli)."""
from mla_ext.cli import main

raise SystemExit(main())
