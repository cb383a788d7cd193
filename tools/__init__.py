"""Developer tools, not part of the torchshard package: the conformance matrix and the tiny model families.

The matrix reuses the test suite's references and tolerances, whose modules import each other by bare
name (``from helpers import ...``), so importing this package puts ``tests/`` on ``sys.path``.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "tests") not in sys.path:
    sys.path.append(str(ROOT / "tests"))
