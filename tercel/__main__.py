"""python -m tercel ...: the same as the `tercel` command."""
import sys

from .cli import main

sys.exit(main())
