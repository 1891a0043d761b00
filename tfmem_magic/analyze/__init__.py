"""Turning what was measured into the report's breakdown: live tensors at the peak, the model's description."""
