"""The checkout's root: where the tests find its files and run its modules and scripts from."""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
