"""Capture: which layers K-FAC sees, and their inputs and output cotangents."""
