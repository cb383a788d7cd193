"""Context parallelism: the option, ring and all-gather attention, packed documents, the Trainer binding."""
