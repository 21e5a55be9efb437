"""``python -m testing.soak``: see :mod:`testing.soak.runner`."""

import sys

if __name__ == "__main__":  # forkserver children re-run this module as ``__mp_main__``
    from testing.soak.runner import main

    sys.exit(main())
