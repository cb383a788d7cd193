"""Trainer.evaluate's tolerance against eager torch, for the evaluate tests and the matrix."""

RTOL = 1e-5  # fp32: evaluate is the same forward as eager torch on the same weights
