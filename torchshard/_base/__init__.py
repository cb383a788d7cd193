"""The vocabulary every layer speaks: errors, partition specs as users write them, validation, tables, reports.

Imports nothing from torchshard.
"""
