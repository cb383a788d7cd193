"""Registers lm-evaluation-harness's model ``"torchshard"`` the moment lm_eval builds its registry.

lm_eval (0.4.13) fills its model registry from its own list and discovers no plugins, so a bare
``lm_eval --model torchshard`` could not see torchshard's model. The file ``torchshard-lm_eval.pth``
that torchshard installs beside its package imports this module at interpreter start-up. It must stay
cheap: the standard library only, no torch, no JAX, no torchshard. It waits for ``lm_eval.models``
(which lm_eval imports to fill its registry, the first time a model is looked up) and then registers
``"torchshard"`` as a lazy placeholder, so ``torchshard.lm_eval`` (and JAX) load only when a run asks
for that model. Registering any earlier would leave lm_eval's registry non-empty, and lm_eval would
then never import its own models.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

MODELS = "lm_eval.models"  # its import fills the registry with lm_eval's own models
TARGET = "torchshard.lm_eval:TorchshardLM"


def _register() -> None:
    from lm_eval.api.registry import model_registry

    if "torchshard" not in model_registry:
        model_registry.register("torchshard", target=TARGET)


class _RegistryFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of ``lm_eval.models`` so "torchshard" is registered after it runs."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name != MODELS:
            return None
        sys.meta_path.remove(self)  # once: the real finders resolve the module, and later imports are cached
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            run(module)
            _register()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Registers now if ``lm_eval.models`` is already imported, else when it is."""
    if MODELS in sys.modules:
        _register()
    elif not any(isinstance(finder, _RegistryFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegistryFinder())


install()
