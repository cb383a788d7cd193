"""Context parallelism: the option, ring and all-gather attention, packed documents, the binding, the search hook."""
