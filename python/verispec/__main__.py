"""``python -m verispec``: the same command line as ``verispec`` (see verispec.cli)."""

from verispec.cli import main

raise SystemExit(main())
