"""Preconditioning: eigen and inverse forms of (A ⊗ G + λI)⁻¹, KL clipping."""
