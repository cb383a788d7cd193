"""Expert parallelism: the option, the all-to-all dispatch of tokens to experts, the binding, the search hook."""
