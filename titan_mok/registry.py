"""Registers titan-mok's models as TorchTitan TrainSpecs (user specs win in
`get_train_spec`). Each name is a package `titan_mok.models.<name>` with a
`get_train_spec()` and a `<name>_configs` dict of flavors. Beside them, the
end-to-end baseline: TorchTitan's own deepseek_v3 at Kimi K2.7 Code's flavors
(`titan_mok.baseline`, registered as `BASELINE_MODEL`)."""

import dataclasses
import importlib

from torchtitan.protocols.train_spec import get_train_spec, register_train_spec

from titan_mok.baseline import BASELINE_MODEL, baseline_flavors, baseline_train_spec
from titan_mok.metrics import build_mok_metrics_processor

MODELS = (
    "kimi_k2_7_code",
    "glm_5_2",
    "qwen3_5_397b_a17b",
    "deepseek_v4_pro",
)


def model_module(name: str):
    if name not in MODELS:
        raise ValueError(f"[model] name = {name!r} is not a titan-mok model; choose one of {list(MODELS)}")
    return importlib.import_module(f"titan_mok.models.{name}")


def flavors(name: str) -> dict:
    """The flavor → model args dict of a registered model (titan-mok's, or the baseline)."""
    if name == BASELINE_MODEL:
        return baseline_flavors()
    return getattr(model_module(name), f"{name}_configs")


def register_all() -> None:
    """Idempotent: registering twice would make TorchTitan raise."""
    for name in MODELS:
        try:
            get_train_spec(name)
        except ValueError:
            spec = model_module(name).get_train_spec()
            # Every titan-mok model logs through titan-mok's metrics processor.
            spec = dataclasses.replace(spec, build_metrics_processor_fn=build_mok_metrics_processor)
            register_train_spec(name, spec)
    try:
        get_train_spec(BASELINE_MODEL)
    except ValueError:
        register_train_spec(BASELINE_MODEL, baseline_train_spec(build_mok_metrics_processor))
