"""`python -m fewclip.cli`: the `fewclip` command."""
import sys

from fewclip.cli.main import main

sys.exit(main())
