"""python -m tercel ...: the same as the `tercel` command."""
from .cli import main

raise SystemExit(main())
