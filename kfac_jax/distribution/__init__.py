"""Spreading the second-order work over a device mesh (KAISA's strategies)."""
