"""The fused loss (``Trainer(fused_loss=)``): the option, the LM head's loss from its input, the Trainer binding."""
