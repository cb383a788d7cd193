"""Reading plans and steps: the plan CLI, memory figures, visualisation, collectives counted from the compiled HLO.

May import _interop and everything below it.
"""
