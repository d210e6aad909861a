"""`python -m engine chat "..."` is `python -m engine.cli chat "..."`."""
import sys

from engine.cli import main

sys.exit(main())
