"""Developer tools, not part of the torchshard package: the conformance matrix and the tiny model families.

The matrix reuses the test suite's references and tolerances from ``testsupport`` (the clone's root, as ``tools``).
"""
