"""The vocabulary every layer speaks: errors, partition specs as users write them, validation, tables.

Imports nothing from torchshard.
"""
