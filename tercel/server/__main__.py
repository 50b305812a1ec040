"""python -m tercel.server [MODEL] [flags]: the same as `tercel serve`."""
import sys

from .cli import main

sys.exit(main())
