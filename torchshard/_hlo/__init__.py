"""Reading compiled programs: FLOPs, bytes and collectives with loop trip counts, memory, and hardware peaks.

Shared by the Trainer's run metrics (_train) and the plan search (_report). May import _parallel and everything
below it.
"""
