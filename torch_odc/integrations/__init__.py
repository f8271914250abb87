"""Integrations of torch-odc with training frameworks (imported on demand, never by torch_odc).

* :mod:`torch_odc.integrations.hf`: the Hugging Face ``transformers.Trainer`` and TRL's
  ``SFTTrainer`` (needs ``transformers`` and ``accelerate``; ``trl`` for the SFT trainer).
* :mod:`torch_odc.integrations.verl`: verl 0.9.1's FSDP2 engine as engine strategy ``"odc"``
  (needs ``verl``; it lives in its own environment, see docs/integrations.md).
"""
