"""``python -m benchmarks.soak``: see :mod:`benchmarks.soak.runner`."""

import sys

if __name__ == "__main__":  # forkserver children re-run this module as ``__mp_main__``
    from benchmarks.soak.runner import main

    sys.exit(main())
