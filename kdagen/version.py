"""The generator's version: a leaf module, so that modules needing it do not import the package root."""

from __future__ import annotations

__version__ = "0.1.0"
