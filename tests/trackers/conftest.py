"""trackio reads its folder (TRACKIO_DIR) once, when it is imported: each test process gets one of its
own before any test imports trackio, and each test a project of its own in it."""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("TRACKIO_DIR", tempfile.mkdtemp(prefix="fulmen-trackio-"))
