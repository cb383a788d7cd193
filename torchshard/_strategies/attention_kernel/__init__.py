"""The attention-kernel choice (``Trainer(attention_kernel=)``): the option, the binding; the kernels are in _bridge."""
