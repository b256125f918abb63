"""Factors: batch Kronecker factors A and G and their running averages."""
