"""The verl compatibility manifest inside verl's own environment (tests/test_compat.py runs it).

    python tests/compat_verl_cases.py OUT.json

verl lives in its own virtual environment (see tests/test_integrations_verl.py), so the checks
of ``torch_odc/integrations/verl/_compat.py`` against the installed verl run here, in one
process of one rank (a Gloo group of 1):

* ``missing``: what ``_compat.check()`` reports against the installed verl (expected: nothing);
* ``built``: an "odc" engine (``ODCFSDPEngineWithLMHead``) constructed with every listed name
  present (expected: it is);
* ``deleted``: the same after deleting one listed symbol from verl's installed class
  (``FSDPEngine._build_fsdp_module``, restored afterwards): what ``check()`` reports and what
  constructing the engine raises (expected: the manifest's ValueError naming it).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ.setdefault("VERL_PLATFORM", "cpu")
os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VERL_LOGGING_LEVEL", "ERROR")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DELETED = ("verl.workers.engine.fsdp.transformer_impl", "FSDPEngine", "_build_fsdp_module")


def build_engine(model_path: str):
    """An "odc" actor engine, constructed (not initialized: no model is built)."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPOptimizerConfig, HFModelConfig

    from torch_odc.integrations.verl import ODCEngineConfig, ODCFSDPEngineWithLMHead

    return ODCFSDPEngineWithLMHead(
        model_config=HFModelConfig(
            path=model_path, load_tokenizer=False, override_config={"attn_implementation": "eager"}
        ),
        engine_config=ODCEngineConfig(
            strategy="odc",
            model_dtype="fp32",
            use_torch_compile=False,
            use_dynamic_bsz=True,
            max_token_len_per_gpu=48,
            infer_max_token_len_per_gpu=48,
        ),
        optimizer_config=FSDPOptimizerConfig(optimizer="SGD", lr=0.1, total_training_steps=1),
        checkpoint_config=CheckpointConfig(),
    )


def constructed(model_path: str) -> dict:
    try:
        engine = build_engine(model_path)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {
            "ok": False,
            "type": type(e).__name__,
            "mro": [c.__name__ for c in type(e).__mro__],
            "message": str(e),
        }
    return {"ok": True, "class": type(engine).__name__, "active": engine.odc_active}


def main() -> None:
    import importlib
    from importlib import metadata

    import torch
    import torch.distributed as dist

    import torch_odc  # noqa: F401  (registers "odc")
    from torch_odc.integrations.verl import _compat

    out: dict = {
        "versions": {"verl": metadata.version("verl"), "torch": torch.__version__},
        "entries": _compat.MANIFEST.summary(),
        "missing": [m.describe() for m in _compat.check()],
    }
    with tempfile.TemporaryDirectory(prefix="odc-compat-") as tmp:
        dist.init_process_group(
            "gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1
        )
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        try:
            from verl_cases import build_model

            model_path = os.path.join(tmp, "model")
            build_model(model_path)
            out["built"] = constructed(model_path)
            module, cls_name, name = DELETED
            cls = getattr(importlib.import_module(module), cls_name)
            saved = cls.__dict__[name]
            delattr(cls, name)
            try:
                out["deleted"] = {
                    "symbol": f"{cls_name}.{name}",
                    "check": [m.entry.symbol for m in _compat.check("verl")],
                    "constructed": constructed(model_path),
                }
            finally:
                setattr(cls, name, saved)
            out["restored"] = [m.describe() for m in _compat.check()]
        finally:
            dist.destroy_process_group()
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
