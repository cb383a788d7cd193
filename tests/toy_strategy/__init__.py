"""A toy strategy, one folder as the package's are (docs/strategies/writing.md walks through it).

``Trainer(mark=Mark("tag"))`` runs the model's scanned stack through an execution hook that logs
``"tag:stack"`` each time the step is traced; everything else is the plain step. Registered with one
line, ``register(binding.STRATEGY)``, it is a Trainer keyword, an AbstractTrainer keyword, a ``plan
--compile --mark TAG`` flag, a ``plan --search`` option and a ``plan --search --tags`` choice
(tests/test_strategy_seam.py).
"""
