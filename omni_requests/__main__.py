"""``python -m omni_requests``: the same as the ``omni-requests`` command."""

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
