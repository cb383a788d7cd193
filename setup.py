"""setuptools reads everything from pyproject.toml; this file only ships ``torchshard-lm_eval.pth``.

A ``.pth`` file must sit at the top of site-packages, where no pyproject setting puts one: the wheel
gets it from ``build_py``. It imports ``_torchshard_lm_eval``, which registers lm_eval's model
"torchshard" lazily, so a bare ``lm_eval --model torchshard`` finds it (lm_eval discovers no plugins).
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "torchshard-lm_eval.pth"


class BuildPyWithPth(build_py):
    """build_py that also copies the start-up hook's ``.pth`` to the top of the build (the wheel's root)."""

    def run(self) -> None:
        super().run()
        self.copy_file(str(Path(__file__).parent / PTH), str(Path(self.build_lib) / PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


setup(cmdclass={"build_py": BuildPyWithPth})
