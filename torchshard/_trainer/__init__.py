"""The Trainer and what surrounds it: AbstractTrainer, staged init, argument checks, metrics, trackers, prefetch.

The Trainer is one shared state (`core.Core`, built by `assemble`) and parts that receive it: `StateIO`, `Observer`,
`Holding`, the strategy views; no part reads another's private attributes.

May import _strategies and everything below it. It composes the strategies of the registry and names none.
"""
