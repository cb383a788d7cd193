"""The Trainer and what surrounds it: AbstractTrainer, staged init, argument checks, metrics, trackers, prefetch.

May import _strategies and everything below it. It composes the strategies of the registry and names none.
"""
