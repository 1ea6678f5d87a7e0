"""Offline environments: arithmetic / unit-conversion tools, Python execution, a toy target."""
