"""Integrations of torch-odc with training frameworks (imported on demand, never by torch_odc).

* :mod:`torch_odc.integrations.hf`: the Hugging Face ``transformers.Trainer`` and TRL's
  ``SFTTrainer`` (needs ``transformers`` and ``accelerate``; ``trl`` for the SFT trainer).
* :mod:`torch_odc.integrations.verl`: verl 0.9.1's FSDP2 engine as engine strategy ``"odc"``
  (needs ``verl``; it lives in its own environment, see docs/integrations/verl.md).

Each has a compatibility manifest, ``hf/_compat.py`` and ``verl/_compat.py`` (machinery in
``_manifest.py``): every name of the frameworks the adapters use beyond their public API, with
the release it was read in; the adapters reach those names only through it and refuse, at
construction, a release that lacks one (``tests/test_compat.py``).
"""
