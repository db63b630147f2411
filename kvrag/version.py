"""kvrag's version: the one place it is written (pyproject reads it from here)."""

__all__ = ["VERSION"]

VERSION = "0.1.0"
