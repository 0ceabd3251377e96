"""Shared test setup: small configs and a bounded multi-process runner."""

from __future__ import annotations

import os
import sys

import pytest

# Job functions for spawned ranks must be importable by module name in the children.
sys.path.insert(0, os.path.dirname(__file__))
