"""Makes the import of one module slow in the processes that put this folder on PYTHONPATH: the module
named by TEST_SLOW_IMPORT waits TEST_SLOW_IMPORT_S (default 60) before it is imported,
after a line on stderr, so a test can SIGTERM a service in the middle of its start-up's imports."""

from __future__ import annotations

import os
import sys
import time

_NAME = os.environ.get("TEST_SLOW_IMPORT", "")


class _SlowImport:
    """A meta path finder that finds nothing: it only waits, once, before the real finders run."""

    waited = False

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == _NAME and not self.waited:
            self.waited = True
            print(f"slow import of {name}", file=sys.stderr, flush=True)
            time.sleep(float(os.environ.get("TEST_SLOW_IMPORT_S", "60")))


if _NAME:
    sys.meta_path.insert(0, _SlowImport())
